// int4 weight x bf16 activation product for few rows (decode steps), on torch's own int4 packing.
//
// Why a kernel of our own at few rows: torch's _weight_int4pack_mm_for_cpu has no out=, so a replica group's
// o_proj / down outputs were computed into a temporary and copied into their shared-memory slot; and the tiled
// kernel of int4_gemm.cpp, which writes every weight once into an fp32 tile and reads it back per row, is
// slower than the product itself at a few rows. Here each k's weights are dequantized in registers and used at
// once by every row of the pass.
//
// The arithmetic is torch's, operation for operation: w = fma(code - 8, scale, zero) in fp32 (code - 8 looked up
// in a 16-entry table by the code), acc = fma(a_k, w_k, acc) for k = 0, 1, ..., K-1, rounded to bf16 once. So
// each row's result is bit for bit torch's kernel and the tiled kernel's, whatever the number of rows.
//
// Tasks, taken by the threads from a shared counter (tasks.h), are a column unit times a group of rows:
//   - a block of 64 columns (torch's packing: per k 32 bytes; byte d < 16 holds columns d and 32 + d in its low
//     and high nibbles, byte 16 + d columns 16 + d and 48 + d), groups of 4 rows;
//   - or, when that makes fewer than 4 tasks per thread, half a block: the 16 bytes per k of columns h*16.. and
//     32 + h*16.., groups of 8 rows (a 448-wide layer at 1 row: 14 tasks instead of 7);
//   - 16 columns of a last block of 16, 32 or 48 (neighbour pairs: byte j holds columns 2j and 2j + 1).
// A group's rows share each k's dequantized weights; another group dequantizes them again.

#include "int4_few_rows.h"

#include <ATen/Parallel.h>

#include "simd.h"
#include "tasks.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <vector>

namespace cpuserve_int4 {

namespace {

using bf16 = at::BFloat16;

#if defined(__AVX512F__)
using cpuserve_simd::load16;
using cpuserve_simd::to_bf16_exact;  // keeps denormals: every bit matches torch's kernel

// 16 columns' (scale, zero) bf16 pairs -> scale[16], zero[16] in fp32 (exact)
inline void load_scale_zero(const bf16* pairs, __m512& scale, __m512& zero) {
  const __m512 lo = load16(pairs), hi = load16(pairs + 16);  // (s0, z0, ..., s7, z7), (s8, z8, ..., s15, z15)
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  scale = _mm512_permutex2var_ps(lo, even, hi);
  zero = _mm512_permutex2var_ps(lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi);
}

// Where a task's codes are: C vectors of 16 columns; codes(k, q) gives each vector's 16 codes of input k in the
// low 4 bits of 32-bit lanes (vpermps reads only those bits, so the rest need no masking).
struct WholeBlock {
  static constexpr int C = 4, kMaxRows = 4;
  const uint8_t* bytes;  // the block's K x 32 bytes
  int64_t n0;
  int64_t col(int c) const { return n0 + 16 * c; }  // q[0], q[1] low nibbles of bytes 0-15 / 16-31; q[2], q[3] high
  void codes(int64_t k, __m512i* q) const {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + k * 32));
    q[0] = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(b));
    q[1] = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(b, 1));
    q[2] = _mm512_srli_epi32(q[0], 4);
    q[3] = _mm512_srli_epi32(q[1], 4);
  }
};

struct HalfBlock {
  static constexpr int C = 2, kMaxRows = 8;
  const uint8_t* bytes;  // the block's bytes + 16 * h
  int64_t n0;            // the block's first column + 16 * h
  int64_t col(int c) const { return n0 + 32 * c; }
  void codes(int64_t k, __m512i* q) const {
    q[0] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + k * 32)));
    q[1] = _mm512_srli_epi32(q[0], 4);
  }
};

struct TailColumns {
  static constexpr int C = 1, kMaxRows = 8;
  const uint8_t* bytes;  // the last block's bytes + 8 * i
  int64_t stride;        // bytes per k: the last block's width / 2
  int64_t n0;
  int64_t col(int) const { return n0; }
  void codes(int64_t k, __m512i* q) const {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + k * stride));
    q[0] = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, _mm_srli_epi16(b, 4)));  // columns 2j, 2j + 1 <- byte j
  }
};

// out rows 0..R-1 of the task's columns = x rows 0..R-1 times the task's weights
template <int R, typename Codes>
void pass(const float* x, int64_t K, const Codes& src, const bf16* sz, int64_t N, int64_t group, bf16* out) {
  constexpr int C = Codes::C;
  const __m512 minus_eight = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  __m512 acc[R][C], scale[C], zero[C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += group) {
    for (int c = 0; c < C; ++c) load_scale_zero(sz + ((k0 / group) * N + src.col(c)) * 2, scale[c], zero[c]);
    for (int64_t k = k0; k < k0 + group; ++k) {
      __m512i q[C];
      src.codes(k, q);
      __m512 w[C];
      for (int c = 0; c < C; ++c) w[c] = _mm512_fmadd_ps(_mm512_permutexvar_ps(q[c], minus_eight), scale[c], zero[c]);
      for (int r = 0; r < R; ++r) {
        __m512 a = _mm512_set1_ps(x[r * K + k]);
        asm("" : "+v"(a));  // one broadcast into a register, not a broadcast load folded into each of C fmas
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(a, w[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * N + src.col(c)), to_bf16_exact(acc[r][c]));
}

// A task's group of rows (1..Codes::kMaxRows) in one pass
template <typename Codes>
void group_pass(const float* x, int64_t rows, int64_t K, const Codes& src, const bf16* sz, int64_t N,
                int64_t group, bf16* out) {
  constexpr int R = Codes::kMaxRows;
  static_assert(R == 4 || R == 8, "the switch below covers 1..8 rows");
  switch (rows) {
    case 8: if constexpr (R >= 8) pass<8>(x, K, src, sz, N, group, out); break;
    case 7: if constexpr (R >= 7) pass<7>(x, K, src, sz, N, group, out); break;
    case 6: if constexpr (R >= 6) pass<6>(x, K, src, sz, N, group, out); break;
    case 5: if constexpr (R >= 5) pass<5>(x, K, src, sz, N, group, out); break;
    case 4: pass<4>(x, K, src, sz, N, group, out); break;
    case 3: pass<3>(x, K, src, sz, N, group, out); break;
    case 2: pass<2>(x, K, src, sz, N, group, out); break;
    case 1: pass<1>(x, K, src, sz, N, group, out); break;
  }
}
#endif

}  // namespace

void few_rows_gemm(const bf16* x, int64_t M, int64_t K, const uint8_t* packed, int64_t group, const bf16* sz,
                   int64_t N, bf16* out) {
#if defined(__AVX512F__)
  thread_local std::vector<float> xf;  // x in fp32 (exact), converted once for every task
  xf.resize(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(x[i]);
  const float* xd = xf.data();
  // A task is one column unit (a block, half a block or 16 tail columns) times one group of rows, as in torch's
  // kernel: 9 blocks x 2 groups of 4 rows split 9/9 between 2 threads, where 9 blocks alone would split 5/4.
  const int64_t blocks = N / 64, tail = N % 64, threads = at::get_num_threads();
  const bool halves = blocks * ((M + 3) / 4) < 4 * threads;  // too few whole-block tasks to balance
  const int64_t rows_per_group = halves ? HalfBlock::kMaxRows : WholeBlock::kMaxRows;
  const int64_t groups = (M + rows_per_group - 1) / rows_per_group;
  const int64_t units = blocks * (halves ? 2 : 1) + tail / 16;
  const uint8_t* tail_bytes = packed + blocks * K * 32;
  cpuserve_tasks::share_tasks(units * groups, [&](const auto& next) {
    for (int64_t task; (task = next()) >= 0;) {
      const int64_t unit = task / groups, m0 = task % groups * rows_per_group;
      const int64_t rows = std::min(rows_per_group, M - m0);
      const float* xr = xd + m0 * K;
      bf16* o = out + m0 * N;
      if (unit >= units - tail / 16) {
        const int64_t i = unit - (units - tail / 16);
        group_pass(xr, rows, K, TailColumns{tail_bytes + 8 * i, tail / 2, blocks * 64 + 16 * i}, sz, N, group, o);
      } else if (halves) {
        const int64_t nb = unit / 2, h = unit % 2;
        group_pass(xr, rows, K, HalfBlock{packed + nb * K * 32 + 16 * h, nb * 64 + 16 * h}, sz, N, group, o);
      } else {
        group_pass(xr, rows, K, WholeBlock{packed + unit * K * 32, unit * 64}, sz, N, group, o);
      }
    }
  });
#endif
}

}  // namespace cpuserve_int4
