// int4 weight x bf16 activation GEMM with out=, on torch's own int4 packing. Up to kInt4FewRowsMax rows it hands
// off to int4_few_rows.cpp (weights dequantized in registers); this file is the kernel for many rows (batched
// decode, prefill).
//
// torch's _weight_int4pack_mm_for_cpu dequantizes the weight again for every few rows: its cost grows with M
// almost linearly (measured here: 29 us for M=1, 310 us for M=32 on a 1536x576 layer), so a 32-sequence
// decode step spends most of its time there. This kernel dequantizes each block of 64 output columns once per
// call, 128 inputs at a time into an fp32 tile that stays in L1, and streams every row through each tile before
// the next (fp32 accumulators wait in memory between tiles). At 32 rows it runs near the FMA units' peak, 1.5x
// torch's kernel over SmolLM2's four layer shapes.
//
// The arithmetic is torch's, operation for operation: w = fma(code - 8, scale, zero) in fp32, then per row and
// column acc = fma(a_k, w_k, acc) for k = 0, 1, ..., K-1, rounded to bf16 once. So every row's result is bit
// for bit what torch's kernel gives, whatever the number of rows: a request's tokens do not depend on which
// kernel its step took, on the batch it shared, or on a prefix-cache hit shortening its prefill.
//
// torch's CPU packing with AVX-512 (aten/src/ATen/native/cpu/int4mm_kernel.cpp, weight_to_int4pack_kernel):
// blocks of 64 output rows n; per block and input k, 32 bytes; byte d < 16 holds n = d (low nibble) and n = d + 32
// (high nibble), byte 16 + d holds n = 16 + d and n = 48 + d. w = (code - 8) * scale + zero, per group of k.
// A last block of 16, 32 or 48 rows packs pairs of neighbours instead: per k, byte j holds n = 2j (low nibble)
// and n = 2j + 1 (high). engine/layers/native.py checks both layouts against torch's kernel before using them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "int4_few_rows.h"
#include "tasks.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define CPUSERVE_INT4_GEMM 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

using bf16 = at::BFloat16;
constexpr int64_t kBlockN = 64;  // torch's AVX-512 packing block
constexpr int kRows = 6;         // rows per register block: 6 x 4 accumulators + 4 weight vectors
constexpr int64_t kChunkK = 128;  // inputs per dequantized chunk: 128 x 64 fp32 = 32 KiB, within L1

bool int4_gemm_supported() {
#if defined(CPUSERVE_INT4_GEMM)
  return true;
#else
  return false;
#endif
}

#if defined(CPUSERVE_INT4_GEMM)
// Inputs k0..k1-1 of one block of 64 output columns as fp32 tile[k - k0][64]: w = fma(code - 8, scale, zero), as
// torch's kernel does.
void dequantize_block(const uint8_t* packed, const bf16* sz, int64_t n0, int64_t N, int64_t k0, int64_t k1,
                      int64_t group, float* tile) {
  __m512 scale[4], zero[4];
  for (int64_t k = k0; k < k1; ++k) {
    if (k == k0 || k % group == 0) {
      const bf16* g = sz + ((k / group) * N + n0) * 2;  // [64][2] (scale, zero) pairs of this group
      for (int c = 0; c < 4; ++c) {
        alignas(64) float sv[16], zv[16];
        for (int j = 0; j < 16; ++j) {
          sv[j] = static_cast<float>(g[(c * 16 + j) * 2]);
          zv[j] = static_cast<float>(g[(c * 16 + j) * 2 + 1]);
        }
        scale[c] = _mm512_load_ps(sv);
        zero[c] = _mm512_load_ps(zv);
      }
    }
    const __m128i lo_hi[2] = {_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + k * 32)),
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + k * 32 + 16))};
    const __m512 eight = _mm512_set1_ps(8.f);
    for (int half = 0; half < 2; ++half) {  // bytes 0..15: n 0..15 | 32..47; bytes 16..31: n 16..31 | 48..63
      const __m512i b32 = _mm512_cvtepu8_epi32(lo_hi[half]);
      const __m512 lo = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b32, _mm512_set1_epi32(0xF))), eight);
      const __m512 hi = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b32, 4)), eight);
      float* row = tile + (k - k0) * kBlockN;
      _mm512_storeu_ps(row + half * 16, _mm512_fmadd_ps(lo, scale[half], zero[half]));
      _mm512_storeu_ps(row + 32 + half * 16, _mm512_fmadd_ps(hi, scale[2 + half], zero[2 + half]));
    }
  }
}

// The same tile for a last block of nb < 64 columns (neighbour-pair packing); columns nb..63 are zero.
void dequantize_tail_block(const uint8_t* packed, const bf16* sz, int64_t n0, int64_t nb, int64_t N, int64_t k0,
                           int64_t k1, int64_t group, float* tile) {
  std::fill(tile, tile + (k1 - k0) * kBlockN, 0.f);
  for (int64_t k = k0; k < k1; ++k) {
    const bf16* g = sz + ((k / group) * N + n0) * 2;
    for (int64_t n = 0; n < nb; ++n) {
      const uint8_t byte = packed[k * (nb / 2) + n / 2];
      const int code = n % 2 ? byte >> 4 : byte & 0x0F;
      tile[(k - k0) * kBlockN + n] = std::fma(static_cast<float>(code) - 8.f, static_cast<float>(g[n * 2]),
                                       static_cast<float>(g[n * 2 + 1]));
    }
  }
}

// acc[r][0..64) += rows r of x (inputs k0..k0+kc-1) times the tile, acc = fma(a_k, w_k, acc) over k in order.
// The accumulators are fp32 in memory between chunks, so chunking the k loop changes no bit.
template <int R>
void rows_times_tile(const float* x, int64_t K, int64_t k0, int64_t kc, const float* tile, float* acc_mem) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_loadu_ps(acc_mem + r * kBlockN + c * 16);
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 w0 = _mm512_loadu_ps(tile + k * kBlockN), w1 = _mm512_loadu_ps(tile + k * kBlockN + 16);
    const __m512 w2 = _mm512_loadu_ps(tile + k * kBlockN + 32), w3 = _mm512_loadu_ps(tile + k * kBlockN + 48);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * K + k0 + k]);
      acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(a, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(a, w3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc_mem + r * kBlockN + c * 16, acc[r][c]);
}
#endif

// The inputs' checks; returns {M, N}.
std::pair<int64_t, int64_t> check_inputs(const at::Tensor& x, const at::Tensor& packed, int64_t group_size,
                                         const at::Tensor& scales_and_zeros) {
  TORCH_CHECK(int4_gemm_supported(), "int4_gemm needs AVX-512 (it was built without it for this CPU)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x must be contiguous bf16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed must be torch's uint8 int4 packing");
  TORCH_CHECK(scales_and_zeros.scalar_type() == at::kBFloat16 && scales_and_zeros.dim() == 3 &&
                  scales_and_zeros.is_contiguous(),
              "scales_and_zeros must be contiguous bf16 [K / group, N, 2]");
  const int64_t M = x.size(0), K = x.size(1), N = scales_and_zeros.size(1);
  TORCH_CHECK(N % 16 == 0, "int4_gemm needs N to be a multiple of 16 (torch's packing), got ", N);
  TORCH_CHECK(K % group_size == 0 && group_size % 2 == 0 && scales_and_zeros.size(0) == K / group_size,
              "K=", K, " must be whole groups of ", group_size);
  TORCH_CHECK(packed.numel() == N * K / 2, "packed holds ", packed.numel(), " bytes, expected N * K / 2 = ", N * K / 2);
  return {M, N};
}

// out: contiguous bf16 [M, N], written in place (a replica group's shared-memory slot: no copy afterwards).
at::Tensor& int4_gemm_out(const at::Tensor& x, const at::Tensor& packed, int64_t group_size,
                          const at::Tensor& scales_and_zeros, at::Tensor& out) {
  const auto shape = check_inputs(x, packed, group_size, scales_and_zeros);  // {M, N}
  const int64_t M = shape.first, N = shape.second;
  const int64_t K = x.size(1);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.sizes() == at::IntArrayRef({M, N}),
              "out must be contiguous bf16 [M, N] = [", M, ", ", N, "], got ", out.scalar_type(), " ", out.sizes(),
              out.is_contiguous() ? "" : " (not contiguous)");
#if defined(CPUSERVE_INT4_GEMM)
  const uint8_t* pd = packed.data_ptr<uint8_t>();
  const bf16* sz = scales_and_zeros.data_ptr<bf16>();
  if (M <= cpuserve_int4::kInt4FewRowsMax) {  // decode: weights dequantized in registers (int4_few_rows.cpp)
    cpuserve_int4::few_rows_gemm(x.data_ptr<bf16>(), M, K, pd, group_size, sz, N, out.data_ptr<bf16>());
    return out;
  }
  const at::Tensor xf = x.to(at::kFloat);  // bf16 -> fp32 is exact; once per call, not once per column block
  const float* xd = xf.data_ptr<float>();
  bf16* od = out.data_ptr<bf16>();
  // Tasks: whole column blocks first, then the blocks left over when they do not divide evenly among the threads
  // (9 blocks of a 576-wide layer on 2 threads), each split into one row part per thread; a part dequantizes its
  // block itself. Threads take tasks from a shared counter (tasks.h).
  const int64_t blocks = (N + kBlockN - 1) / kBlockN, threads = at::get_num_threads();
  const int64_t whole = M >= 2 * kRows * threads ? blocks / threads * threads : blocks;
  const int64_t part_rows = (M + threads - 1) / threads;
  struct Scratch {
    std::vector<float> tile, acc;
  };
  // out[m_begin..m_end, block nb] = x rows times the block, the k loop in chunks of kChunkK
  auto run = [&](Scratch& s, int64_t nb, int64_t m_begin, int64_t m_end) {
    float* tile = s.tile.data();
    const int64_t cols = std::min(kBlockN, N - nb * kBlockN);
    std::fill(s.acc.begin(), s.acc.end(), 0.f);
    for (int64_t k0 = 0; k0 < K; k0 += kChunkK) {  // a chunk of the tile stays in L1 while every row uses it
      const int64_t kc = std::min(kChunkK, K - k0);
      if (cols == kBlockN)
        dequantize_block(pd + nb * K * kBlockN / 2, sz, nb * kBlockN, N, k0, k0 + kc, group_size, tile);
      else
        dequantize_tail_block(pd + nb * K * kBlockN / 2, sz, nb * kBlockN, cols, N, k0, k0 + kc, group_size, tile);
      int64_t m = m_begin;
      for (; m + kRows <= m_end; m += kRows)
        rows_times_tile<kRows>(xd + m * K, K, k0, kc, tile, s.acc.data() + (m - m_begin) * kBlockN);
      const float* xr = xd + m * K;
      float* ar = s.acc.data() + (m - m_begin) * kBlockN;
      switch (m_end - m) {  // the last rows in one register block too (a row's arithmetic is the same in any)
        case 5: rows_times_tile<5>(xr, K, k0, kc, tile, ar); break;
        case 4: rows_times_tile<4>(xr, K, k0, kc, tile, ar); break;
        case 3: rows_times_tile<3>(xr, K, k0, kc, tile, ar); break;
        case 2: rows_times_tile<2>(xr, K, k0, kc, tile, ar); break;
        case 1: rows_times_tile<1>(xr, K, k0, kc, tile, ar); break;
      }
    }
    for (int64_t m = m_begin; m < m_end; ++m)
      for (int64_t j = 0; j < cols; ++j)
        od[m * N + nb * kBlockN + j] = static_cast<bf16>(s.acc[(m - m_begin) * kBlockN + j]);
  };
  cpuserve_tasks::share_tasks(whole + (blocks - whole) * threads, [&](const auto& next) {
    Scratch s{std::vector<float>(kChunkK * kBlockN), std::vector<float>(M * kBlockN)};
    for (int64_t task; (task = next()) >= 0;) {
      if (task < whole) {
        run(s, task, 0, M);
        continue;
      }
      const int64_t nb = whole + (task - whole) / threads, part = (task - whole) % threads;
      const int64_t m_begin = std::min(M, part * part_rows), m_end = std::min(M, (part + 1) * part_rows);
      if (m_begin < m_end) run(s, nb, m_begin, m_end);
    }
  });
#endif
  return out;
}

at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t group_size,
                     const at::Tensor& scales_and_zeros) {
  const auto shape = check_inputs(x, packed, group_size, scales_and_zeros);  // {M, N}
  const int64_t M = shape.first, N = shape.second;
  auto out = at::empty({M, N}, x.options());
  int4_gemm_out(x, packed, group_size, scales_and_zeros, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cpuserve, m) {
  m.def("int4_gemm(Tensor x, Tensor packed, int group_size, Tensor scales_and_zeros) -> Tensor");
  m.def("int4_gemm.out(Tensor x, Tensor packed, int group_size, Tensor scales_and_zeros, *, Tensor(a!) out) -> "
        "Tensor(a!)");
  m.def("int4_gemm_supported() -> bool");
}

TORCH_LIBRARY_IMPL(cpuserve, CPU, m) {
  m.impl("int4_gemm", &int4_gemm);
  m.impl("int4_gemm.out", &int4_gemm_out);
}

TORCH_LIBRARY_IMPL(cpuserve, CompositeExplicitAutograd, m) {
  m.impl("int4_gemm_supported", &int4_gemm_supported);
}
