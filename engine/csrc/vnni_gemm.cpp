// int4 / int8 weights x dynamic int8 activations with integer dot products (AVX-512 VNNI vpdpbusd), with out=.
//
// The bf16 kernels (int4_gemm.cpp, int8_gemm.cpp) dequantize weights to fp32 and run FMAs: 16 multiply-adds per
// instruction. vpdpbusd does 64 (16 lanes x 4 byte pairs), so once activations are int8 (act_quant.h, each row on
// its own) the same units do 4x the work, and weights never leave their packed bytes.
//
// Layouts (packed once at load, engine/layers/linear/act_int8.py; N is a multiple of 16):
//
//   w4a8  packed [N/16][K/8][64] uint8: the 16 columns c of a block and inputs k0..k0+7 as 64 bytes, byte 4c + j
//         holding code(c, k0 + j) in its low nibble and code(c, k0 + 4 + j) in its high one; masking and shifting
//         a 64-byte load gives two vpdpbusd operands (unsigned codes 0..15 x signed activations).
//         scales, zoffs [N/16][K/group][16] fp32: w = code * scale + zoff (zoff = zero - 8 * scale), so per group
//           y += float(sum code * q) * scale * ax + zoff * axs.
//   w8a8  packed [N/16][K/4][64] int8: byte 4c + j = w(c, k0 + j). vpdpbusd wants one unsigned operand: the
//         activations go in as q + 128 (a sign-bit flip) and comp[n] = 128 * sum_k w(n, k) is taken off again.
//         scales [N] fp32; y = float(acc - comp) * scale * ax with one activation scale per row: the whole dot
//         product is integer.
//
// Integer sums are exact and each output element's float epilogue runs in the same order (groups in k order)
// whatever the register block, task or thread that computes it: a row's result does not depend on the batch, the
// tiling or the thread count.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "act_quant.h"
#include "simd.h"
#include "tasks.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define CPUSERVE_VNNI 1
#endif

#include <algorithm>
#include <cstdint>

namespace {

using bf16 = at::BFloat16;
constexpr int64_t kPrefetch = 1024;  // bytes ahead in a column block's stream (tasks interleave between threads)
constexpr int64_t kQuantRowsPerTask = 8;

bool vnni_gemm_supported() {
#if defined(CPUSERVE_VNNI)
  return true;
#else
  return false;
#endif
}

#if defined(CPUSERVE_VNNI)
using cpuserve_simd::to_bf16;

inline __m512i bcast4(const int8_t* p) { return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p)); }

// R rows x C blocks of 16 columns of the int4 GEMM.
template <int R, int C>
void w4a8_block(const int8_t* q, const float* ax, const float* axs, int64_t K, int64_t group, const uint8_t* w,
                const float* sc, const float* zo, bf16* out, int64_t ldo) {
  const int64_t G = K / group, wstride = K * 8, sstride = G * 16;  // per column block: K/8 x 64 bytes, G x 16
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 y[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
    for (int64_t k = g * group; k < (g + 1) * group; k += 8) {
      __m512i lo[C], hi[C];
      for (int c = 0; c < C; ++c) {
        const uint8_t* p = w + c * wstride + k * 8;
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch), _MM_HINT_T0);
        const __m512i raw = _mm512_loadu_si512(p);
        lo[c] = _mm512_and_si512(raw, low);
        hi[c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i a0 = bcast4(q + r * K + k), a1 = bcast4(q + r * K + k + 4);
        for (int c = 0; c < C; ++c) {
          acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], lo[c], a0);
          acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], hi[c], a1);
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      const __m512 s = _mm512_loadu_ps(sc + c * sstride + g * 16), z = _mm512_loadu_ps(zo + c * sstride + g * 16);
      for (int r = 0; r < R; ++r) {
        const __m512 t = _mm512_mul_ps(s, _mm512_set1_ps(ax[r * G + g]));
        y[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), t, y[r][c]);
        y[r][c] = _mm512_fmadd_ps(z, _mm512_set1_ps(axs[r * G + g]), y[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + c * 16), to_bf16(y[r][c]));
}

// R rows x C blocks of 16 columns of the int8 GEMM.
template <int R, int C>
void w8a8_block(const int8_t* q, const float* ax, int64_t K, const int8_t* w, const float* sc, const int32_t* comp,
                bf16* out, int64_t ldo) {
  const int64_t wstride = K * 16;  // per column block: K/4 x 64 bytes
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 4) {
    __m512i wv[C];
    for (int c = 0; c < C; ++c) {
      const int8_t* p = w + c * wstride + k * 16;
      _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch), _MM_HINT_T0);
      wv[c] = _mm512_loadu_si512(p);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_xor_si512(bcast4(q + r * K + k), flip);  // q + 128 as unsigned bytes
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], a, wv[c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    const __m512i cp = _mm512_loadu_si512(comp + c * 16);
    const __m512 s = _mm512_loadu_ps(sc + c * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][c], cp));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + c * 16),
                          to_bf16(_mm512_mul_ps(v, _mm512_mul_ps(s, _mm512_set1_ps(ax[r])))));
    }
  }
}

// One task's columns of each GEMM: run<R, C>(m) computes rows m..m+R-1 of its first C column blocks
struct W4A8Block {
  const int8_t* q; const float *ax, *axs; int64_t K, group, G; const uint8_t* w; const float *sc, *zo;
  bf16* out; int64_t N;
  template <int R, int C> void run(int64_t m) const {
    w4a8_block<R, C>(q + m * K, ax + m * G, axs + m * G, K, group, w, sc, zo, out + m * N, N);
  }
};

struct W8A8Block {
  const int8_t* q; const float* ax; int64_t K; const int8_t* w; const float* sc; const int32_t* comp;
  bf16* out; int64_t N;
  template <int R, int C> void run(int64_t m) const {
    w8a8_block<R, C>(q + m * K, ax + m, K, w, sc, comp, out + m * N, N);
  }
};

// Every row through `blocks` (1..C) column blocks: kR rows per register block, then the last 1..kR-1
template <int kR, int C, typename Block>
void all_rows(int64_t M, int64_t blocks, const Block& block) {
  static_assert(kR == 4, "the switch below handles the last 1-3 rows");
  int64_t m = 0;
  for (; m + kR <= M; m += kR) blocks == C ? block.template run<kR, C>(m) : block.template run<kR, 1>(m);
  switch (M - m) {
    case 3: blocks == C ? block.template run<3, C>(m) : block.template run<3, 1>(m); break;
    case 2: blocks == C ? block.template run<2, C>(m) : block.template run<2, 1>(m); break;
    case 1: blocks == C ? block.template run<1, C>(m) : block.template run<1, 1>(m); break;
  }
}

// x [M, K] bf16 -> q [M, K] int8 and one scale per act_group, rows shared between threads when there are many
void quantize_rows(const bf16* x, int64_t M, int64_t K, int64_t act_group, int8_t* q, float* scale) {
  const int64_t A = K / act_group;
  const auto rows = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) cpuserve_act::quantize_row(x + m * K, K, act_group, q + m * K, scale + m * A);
  };
  if (M < 2 * kQuantRowsPerTask) return rows(0, M);
  cpuserve_tasks::share_tasks((M + kQuantRowsPerTask - 1) / kQuantRowsPerTask, [&](const auto& next) {
    for (int64_t t; (t = next()) >= 0;) rows(t * kQuantRowsPerTask, std::min(M, (t + 1) * kQuantRowsPerTask));
  });
}
#endif

void check_x(const at::Tensor& x, int64_t K, int64_t N, const at::Tensor& out) {
  TORCH_CHECK(vnni_gemm_supported(), "the int8 dot-product GEMMs need AVX-512 VNNI (this CPU's build has none)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous() && x.size(1) == K,
              "x must be contiguous bf16 [M, ", K, "], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() &&
                  out.sizes() == at::IntArrayRef({x.size(0), N}),
              "out must be contiguous bf16 [", x.size(0), ", ", N, "], got ", out.scalar_type(), " ", out.sizes());
}

// x [M, K] bf16; packed [N/16, K/8, 64] uint8; scales, zoffs [N/16, K/group, 16] fp32 -> out [M, N] bf16
at::Tensor& w4a8_gemm_out(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                          const at::Tensor& zoffs, int64_t group, int64_t act_group, at::Tensor& out) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == 64 && packed.is_contiguous(),
              "packed must be contiguous uint8 [N/16, K/8, 64]");
  const int64_t N = packed.size(0) * 16, K = packed.size(1) * 8, M = x.size(0);
  TORCH_CHECK(group >= 16 && K % group == 0 && group % 16 == 0, "group_size=", group, " must divide K=", K);
  TORCH_CHECK(act_group % group == 0 && K % act_group == 0, "act_group=", act_group, " must be a multiple of ",
              "group_size=", group, " dividing K=", K);
  for (const auto* t : {&scales, &zoffs})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->sizes() == at::IntArrayRef({N / 16, K / group, 16}),
                "scales and zoffs must be contiguous fp32 [N/16, K/group, 16]");
  check_x(x, K, N, out);
#if defined(CPUSERVE_VNNI)
  const int64_t G = K / group;
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto terms = at::empty({3, M, G}, x.options().dtype(at::kFloat));  // act scales, then ax and axs per group
  int8_t* qd = q.data_ptr<int8_t>();
  float *scale = terms[0].data_ptr<float>(), *ax = terms[1].data_ptr<float>(), *axs = terms[2].data_ptr<float>();
  quantize_rows(x.data_ptr<bf16>(), M, K, act_group, qd, scale);
  for (int64_t m = 0; m < M; ++m)
    cpuserve_act::group_terms(qd + m * K, scale + m * (K / act_group), K, act_group, group, ax + m * G, axs + m * G);
  const uint8_t* wd = packed.data_ptr<uint8_t>();
  const float *sd = scales.data_ptr<float>(), *zd = zoffs.data_ptr<float>();
  bf16* od = out.data_ptr<bf16>();
  constexpr int C = 2;  // 4 rows x 2 blocks: 8 int32 + 8 fp32 accumulators, 4 weight vectors
  const int64_t num_blocks = N / 16;
  cpuserve_tasks::share_tasks((num_blocks + C - 1) / C, [&](const auto& next) {
    for (int64_t t; (t = next()) >= 0;) {
      const int64_t b0 = t * C;
      const W4A8Block block{qd, ax, axs, K, group, G, wd + b0 * K * 8, sd + b0 * G * 16, zd + b0 * G * 16,
                        od + b0 * 16, N};
      all_rows<4, C>(M, std::min<int64_t>(C, num_blocks - b0), block);
    }
  });
#endif
  return out;
}

// x [M, K] bf16; packed [N/16, K/4, 64] int8; scales [N] fp32; comp [N] int32 -> out [M, N] bf16
at::Tensor& w8a8_gemm_out(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                          const at::Tensor& comp, at::Tensor& out) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.size(2) == 64 && packed.is_contiguous(),
              "packed must be contiguous int8 [N/16, K/4, 64]");
  const int64_t N = packed.size(0) * 16, K = packed.size(1) * 4, M = x.size(0);
  TORCH_CHECK(K % 16 == 0, "K=", K, " must be a multiple of 16");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
              "scales must be contiguous fp32 [N]");
  TORCH_CHECK(comp.scalar_type() == at::kInt && comp.is_contiguous() && comp.numel() == N,
              "comp must be contiguous int32 [N]");
  check_x(x, K, N, out);
#if defined(CPUSERVE_VNNI)
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto ax = at::empty({M}, x.options().dtype(at::kFloat));
  int8_t* qd = q.data_ptr<int8_t>();
  float* axd = ax.data_ptr<float>();
  quantize_rows(x.data_ptr<bf16>(), M, K, K, qd, axd);
  const int8_t* wd = packed.data_ptr<int8_t>();
  const float* sd = scales.data_ptr<float>();
  const int32_t* cd = comp.data_ptr<int32_t>();
  bf16* od = out.data_ptr<bf16>();
  constexpr int C = 4;  // 4 rows x 4 blocks: 16 int32 accumulators, 4 weight vectors
  const int64_t num_blocks = N / 16;
  cpuserve_tasks::share_tasks((num_blocks + C - 1) / C, [&](const auto& next) {
    for (int64_t t; (t = next()) >= 0;) {
      const int64_t b0 = t * C;
      const int64_t blocks = std::min<int64_t>(C, num_blocks - b0);
      for (int64_t b = b0; b < b0 + blocks; b += (blocks == C ? C : 1)) {
        const W8A8Block block{qd, axd, K, wd + b * K * 16, sd + b * 16, cd + b * 16, od + b * 16, N};
        all_rows<4, C>(M, blocks == C ? C : 1, block);
      }
    }
  });
#endif
  return out;
}

at::Tensor w4a8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const at::Tensor& zoffs, int64_t group, int64_t act_group) {
  auto out = at::empty({x.size(0), packed.size(0) * 16}, x.options());
  return w4a8_gemm_out(x, packed, scales, zoffs, group, act_group, out);
}

at::Tensor w8a8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& comp) {
  auto out = at::empty({x.size(0), packed.size(0) * 16}, x.options());
  return w8a8_gemm_out(x, packed, scales, comp, out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cpuserve, m) {
  m.def("w4a8_gemm(Tensor x, Tensor packed, Tensor scales, Tensor zoffs, int group_size, int act_group) -> Tensor");
  m.def("w4a8_gemm.out(Tensor x, Tensor packed, Tensor scales, Tensor zoffs, int group_size, int act_group, *, "
        "Tensor(a!) out) -> Tensor(a!)");
  m.def("w8a8_gemm(Tensor x, Tensor packed, Tensor scales, Tensor comp) -> Tensor");
  m.def("w8a8_gemm.out(Tensor x, Tensor packed, Tensor scales, Tensor comp, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("vnni_gemm_supported() -> bool");
}

TORCH_LIBRARY_IMPL(cpuserve, CPU, m) {
  m.impl("w4a8_gemm", &w4a8_gemm);
  m.impl("w4a8_gemm.out", &w4a8_gemm_out);
  m.impl("w8a8_gemm", &w8a8_gemm);
  m.impl("w8a8_gemm.out", &w8a8_gemm_out);
}

TORCH_LIBRARY_IMPL(cpuserve, CompositeExplicitAutograd, m) { m.impl("vnni_gemm_supported", &vnni_gemm_supported); }
