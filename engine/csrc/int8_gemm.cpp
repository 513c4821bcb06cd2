// int8 weight x bf16 activation GEMM for many rows (the lm_head of a batched decode step).
//
// torch's _weight_int8pack_mm dequantizes the weight again for every few rows (measured here: 2.2 ms for one row,
// 15.7 ms for 32 rows on SmolLM2's 49152x576 lm_head). This kernel dequantizes a block of 16 output rows of W
// once per call into an fp32 tile and streams every activation row through it.
//
// The arithmetic is torch's (aten/src/ATen/native/cpu/int8mm_kernel.cpp, AVX-512): w = float(q) * scale, then
// per output element 16 lanes accumulate fma(a[k..k+15], w[k..k+15]) over k in steps of 16, reduced with
// _mm512_reduce_add_ps and rounded to bf16. engine/layers/native.py checks bit equality with torch's kernel
// before using it, so a request's logits do not depend on how many rows shared its step.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "tasks.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define CPUSERVE_INT8_GEMM 1
#endif

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

using bf16 = at::BFloat16;
constexpr int64_t kCols = 16;  // output columns per tile (rows of W)
constexpr int kRowBlock = 4;   // activation rows per register block
constexpr int kColBlock = 4;   // output columns per register block

bool int8_gemm_supported() {
#if defined(CPUSERVE_INT8_GEMM)
  return true;
#else
  return false;
#endif
}

#if defined(CPUSERVE_INT8_GEMM)
// R activation rows x C tile columns, K in steps of 16: acc = fma(a, w, acc), then one horizontal sum each.
template <int R, int C>
void block(const float* x, int64_t K, const float* tile, int64_t c0, bf16* out, int64_t ldo) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 w[C];
    for (int c = 0; c < C; ++c) w[c] = _mm512_loadu_ps(tile + (c0 + c) * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_loadu_ps(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(a, w[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c0 + c] = static_cast<bf16>(_mm512_reduce_add_ps(acc[r][c]));
}

template <int R>
void rows(const float* x, int64_t K, const float* tile, int64_t cols, bf16* out, int64_t ldo) {
  int64_t c = 0;
  for (; c + kColBlock <= cols; c += kColBlock) block<R, kColBlock>(x, K, tile, c, out, ldo);
  for (; c < cols; ++c) block<R, 1>(x, K, tile, c, out, ldo);
}
#endif

// The inputs' checks; returns {M, N}.
std::pair<int64_t, int64_t> check_inputs(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(int8_gemm_supported(), "int8_gemm needs AVX-512 (it was built without it for this CPU)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x must be contiguous bf16 [M, K]");
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous(),
              "weight must be contiguous int8 [N, K]");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.numel() == weight.size(0), "scales must be bf16 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K && K % 16 == 0, "K=", K, " must match the weight and be a multiple of 16");
  return {M, N};
}

// out: contiguous bf16 [M, N], written in place (a replica group's shared-memory slot: no copy afterwards).
at::Tensor& int8_gemm_out(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, at::Tensor& out) {
  const auto shape = check_inputs(x, weight, scales);  // {M, N}
  const int64_t M = shape.first, N = shape.second;
  const int64_t K = x.size(1);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.sizes() == at::IntArrayRef({M, N}),
              "out must be contiguous bf16 [M, N] = [", M, ", ", N, "], got ", out.scalar_type(), " ", out.sizes(),
              out.is_contiguous() ? "" : " (not contiguous)");
#if defined(CPUSERVE_INT8_GEMM)
  const at::Tensor xf = x.to(at::kFloat);  // exact, once per call
  const float* xd = xf.data_ptr<float>();
  const int8_t* wd = weight.data_ptr<int8_t>();
  const bf16* sd = scales.data_ptr<bf16>();
  bf16* od = out.data_ptr<bf16>();
  // one task per tile of kCols output columns, taken from a shared counter (tasks.h)
  cpuserve_tasks::share_tasks((N + kCols - 1) / kCols, [&](const auto& next) {
    std::vector<float> tile(kCols * K);
    for (int64_t nb; (nb = next()) >= 0;) {
      const int64_t n0 = nb * kCols, cols = std::min(kCols, N - n0);
      for (int64_t c = 0; c < cols; ++c) {
        const __m512 s = _mm512_set1_ps(static_cast<float>(sd[n0 + c]));
        for (int64_t k = 0; k < K; k += 16) {
          const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wd + (n0 + c) * K + k));
          _mm512_storeu_ps(tile.data() + c * K + k, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), s));
        }
      }
      int64_t m = 0;
      for (; m + kRowBlock <= M; m += kRowBlock) rows<kRowBlock>(xd + m * K, K, tile.data(), cols, od + m * N + n0, N);
      for (; m < M; ++m) rows<1>(xd + m * K, K, tile.data(), cols, od + m * N + n0, N);
    }
  });
#endif
  return out;
}

at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  const auto shape = check_inputs(x, weight, scales);  // {M, N}
  const int64_t M = shape.first, N = shape.second;
  auto out = at::empty({M, N}, x.options());
  int8_gemm_out(x, weight, scales, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cpuserve, m) {
  m.def("int8_gemm(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  m.def("int8_gemm.out(Tensor x, Tensor weight, Tensor scales, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("int8_gemm_supported() -> bool");
}

TORCH_LIBRARY_IMPL(cpuserve, CPU, m) {
  m.impl("int8_gemm", &int8_gemm);
  m.impl("int8_gemm.out", &int8_gemm_out);
}

TORCH_LIBRARY_IMPL(cpuserve, CompositeExplicitAutograd, m) { m.impl("int8_gemm_supported", &int8_gemm_supported); }
