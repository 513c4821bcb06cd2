// int8 weight x bf16 activation GEMM (the lm_head with int4 weights; every layer with --weights int8), with out=.
//
// torch's _weight_int8pack_mm has no out= (a replica group writes o_proj / down straight into its shared-memory
// slot) and walks its blocks of 4 rows x 4 columns row block first, so a weight too big for the caches (the
// 49152x576 lm_head) streams from memory once per 4 rows. Here a task owns 16 output columns and runs every row
// through them, 4 at a time, while their weights stay in L1: the same speed as torch's kernel at 1-4 rows,
// 1.2-1.4x on the lm_head from 8 rows (measured on AMD EPYC Zen 4). An fp32 tile of dequantized weights, which
// this kernel used before, was 0.6-0.7x torch's kernel there (16 x K fp32 overflows the 32 KiB L1).
//
// The arithmetic is torch's (aten/src/ATen/native/cpu/int8mm_kernel.cpp, AVX-512): w = float(q) * scale, then
// per output element 16 lanes accumulate fma(a[k..k+15], w[k..k+15]) over k in steps of 16, reduced with
// _mm512_reduce_add_ps and rounded to bf16. engine/layers/native.py checks bit equality with torch's kernel
// before using it, so a request's logits do not depend on how many rows shared its step.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"
#include "tasks.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define CPUSERVE_INT8_GEMM 1
#endif

#include <algorithm>
#include <cstdint>
#include <utility>

namespace {

using bf16 = at::BFloat16;
constexpr int64_t kCols = 16;  // output columns per task (rows of W): 16 x K int8 stay in L1 while every row passes
constexpr int kRowBlock = 4;   // activation rows per register block
constexpr int kColBlock = 4;   // output columns per register block
constexpr int64_t kPrefetch = 512;  // bytes ahead in each weight row: tasks interleave between threads, so the
                                    // hardware prefetcher sees short runs (lm_head at 1 row: 0.92x -> ~1.0x torch's)

bool int8_gemm_supported() {
#if defined(CPUSERVE_INT8_GEMM)
  return true;
#else
  return false;
#endif
}

#if defined(CPUSERVE_INT8_GEMM)
using cpuserve_simd::load16;  // 16 bf16 / int8 elements as exact fp32 lanes

// R activation rows x C weight columns (rows of W), K in steps of 16: w = float(q) * scale in registers,
// acc = fma(a, w, acc), then one horizontal sum each.
template <int R, int C>
void block(const bf16* x, int64_t K, const int8_t* weight, const bf16* scales, bf16* out, int64_t ldo) {
  __m512 acc[R][C], scale[C];
  for (int c = 0; c < C; ++c) scale[c] = _mm512_set1_ps(static_cast<float>(scales[c]));
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 w[C];
    for (int c = 0; c < C; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(weight + c * K + k + kPrefetch), _MM_HINT_T0);
      w[c] = _mm512_mul_ps(load16(weight + c * K + k), scale[c]);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 a = load16(x + r * K + k);  // into a register once, not folded into each of C fmas
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(a, w[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = static_cast<bf16>(_mm512_reduce_add_ps(acc[r][c]));
}

// R rows x `cols` columns (the weight's rows from `weight`), kColBlock at a time
template <int R>
void rows(const bf16* x, int64_t K, const int8_t* weight, const bf16* scales, int64_t cols, bf16* out, int64_t ldo) {
  int64_t c = 0;
  for (; c + kColBlock <= cols; c += kColBlock) block<R, kColBlock>(x, K, weight + c * K, scales + c, out + c, ldo);
  for (; c < cols; ++c) block<R, 1>(x, K, weight + c * K, scales + c, out + c, ldo);
}

// Every row of x through `cols` columns, kRowBlock rows per pass and the last ones in one
void all_rows(const bf16* x, int64_t M, int64_t K, const int8_t* weight, const bf16* scales, int64_t cols,
              bf16* out, int64_t ldo) {
  static_assert(kRowBlock == 4, "the switch below handles the last 1-3 rows");
  int64_t m = 0;
  for (; m + kRowBlock <= M; m += kRowBlock) rows<kRowBlock>(x + m * K, K, weight, scales, cols, out + m * ldo, ldo);
  switch (M - m) {
    case 3: rows<3>(x + m * K, K, weight, scales, cols, out + m * ldo, ldo); break;
    case 2: rows<2>(x + m * K, K, weight, scales, cols, out + m * ldo, ldo); break;
    case 1: rows<1>(x + m * K, K, weight, scales, cols, out + m * ldo, ldo); break;
  }
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
  const bf16* xd = x.data_ptr<bf16>();
  const int8_t* wd = weight.data_ptr<int8_t>();
  const bf16* sd = scales.data_ptr<bf16>();
  bf16* od = out.data_ptr<bf16>();
  // one task per kCols output columns, taken from a shared counter (tasks.h)
  cpuserve_tasks::share_tasks((N + kCols - 1) / kCols, [&](const auto& next) {
    for (int64_t nb; (nb = next()) >= 0;) {
      const int64_t n0 = nb * kCols;
      all_rows(xd, M, K, wd + n0 * K, sd + n0, std::min(kCols, N - n0), od + n0, N);
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
