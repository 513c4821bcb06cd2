// Dynamic int8 activations for the int8 dot-product GEMMs (vnni_gemm.cpp).
//
// Each row of x is quantized on its own, symmetrically, one scale per `act_group` inputs (act_group = K: one per
// row): s = absmax / 127, q = round-half-even(x * (127 / absmax)), so x ~= s * q with q in [-127, 127]. A row's
// codes and scales depend on that row alone, never on the batch it shares or the thread that quantizes it.
//
// Each group also gets the sum of its codes and act_sums = scale * that sum, for the weights' zero points
// (vnni_epilogue.h).
// quantize_rows does a GEMM's rows, shared between threads; engine/layers/linear/act_int8.py's quantize_rows is the
// plain-torch reference. The AVX2 build (avx2_gemm.h) computes the same codes and floats, 8 lanes at a time: the
// same multiply, rounding and sums per element.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace cpuserve_act {

// One row x[0, K) bf16 -> q[0, K) int8; scale[K / act_group] fp32. K and act_group are multiples of 16.
inline void quantize_row(const c10::BFloat16* x, int64_t K, int64_t act_group, int8_t* q, float* scale) {
  for (int64_t a0 = 0, a = 0; a0 < K; a0 += act_group, ++a) {
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t k = a0; k < a0 + act_group; k += 16) {
      const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k)));
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))));
    }
    const float absmax = _mm512_reduce_max_ps(vmax);
    scale[a] = absmax / 127.f;
    const __m512 inv = _mm512_set1_ps(absmax > 0.f ? 127.f / absmax : 0.f);
    for (int64_t k = a0; k < a0 + act_group; k += 16) {
      const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k)));
      const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)), inv);
      // vcvtps2dq rounds half to even (the default MXCSR mode), as torch.round does; |v| <= 127 so the
      // saturating narrow never clips
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
    }
  }
}

// The zero points' terms per sum group g of `sum_group` inputs (the activation group, or the weight group when an
// activation group spans several): code_sums[g] = the sum of the row's codes in g; act_sums[g] = scale * code_sums[g]
// when g is an activation group, else code_sums[g] as a float (the kernel multiplies by the activation's scale after
// the weight groups); code_sums16 (optional) [g] = code_sums[g] as int16, which holds it for groups of up to 256
// inputs (used only there).
inline void group_sums(const int8_t* q, const float* scale, int64_t K, int64_t act_group, int64_t sum_group,
                       float* act_sums, int32_t* code_sums, int16_t* code_sums16 = nullptr) {
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += sum_group, ++g) {
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = g0; k < g0 + sum_group; k += 16)
      sum = _mm512_add_epi32(sum, _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k))));
    code_sums[g] = _mm512_reduce_add_epi32(sum);
    if (code_sums16) code_sums16[g] = static_cast<int16_t>(code_sums[g]);
    act_sums[g] = (sum_group == act_group ? scale[g] : 1.f) * static_cast<float>(code_sums[g]);
  }
}

}  // namespace cpuserve_act

#elif defined(__AVX2__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace cpuserve_act {

// 8 bf16 as fp32 lanes (exact)
inline __m256 load8_bf16(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline float reduce_max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t reduce_add8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// As the AVX-512 quantize_row above: the same absmax, scale, multiply and round-half-even per element
inline void quantize_row(const c10::BFloat16* x, int64_t K, int64_t act_group, int8_t* q, float* scale) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t a0 = 0, a = 0; a0 < K; a0 += act_group, ++a) {
    __m256 vmax = _mm256_setzero_ps();
    for (int64_t k = a0; k < a0 + act_group; k += 8)
      vmax = _mm256_max_ps(vmax, _mm256_and_ps(load8_bf16(x + k), abs_mask));
    const float absmax = reduce_max8(vmax);
    scale[a] = absmax / 127.f;
    const __m256 inv = _mm256_set1_ps(absmax > 0.f ? 127.f / absmax : 0.f);
    for (int64_t k = a0; k < a0 + act_group; k += 16) {
      const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(load8_bf16(x + k), inv));
      const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(load8_bf16(x + k + 8), inv));
      // int32 -> int16 -> int8 with saturation (never clips: |v| <= 127); packs work per 128-bit lane, so the
      // quarters are put back in order between the two steps
      const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
      const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), bytes);
    }
  }
}

// As the AVX-512 group_sums above
inline void group_sums(const int8_t* q, const float* scale, int64_t K, int64_t act_group, int64_t sum_group,
                       float* act_sums, int32_t* code_sums, int16_t* code_sums16 = nullptr) {
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += sum_group, ++g) {
    __m256i sum = _mm256_setzero_si256();
    for (int64_t k = g0; k < g0 + sum_group; k += 8)
      sum = _mm256_add_epi32(sum, _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k))));
    code_sums[g] = reduce_add8(sum);
    if (code_sums16) code_sums16[g] = static_cast<int16_t>(code_sums[g]);
    act_sums[g] = (sum_group == act_group ? scale[g] : 1.f) * static_cast<float>(code_sums[g]);
  }
}

}  // namespace cpuserve_act

#endif

#if defined(__AVX512F__) || defined(__AVX2__)
#include "tasks.h"

#include <algorithm>

namespace cpuserve_act {

constexpr int64_t kQuantRowsPerTask = 8;

// x [M, K] bf16 -> per row: act_codes, act_scales per act_group, act_sums and code_sums (and code_sums16) per
// sum_group (group_sums), act_row_sum (int8_gemm_operands.h); rows shared between threads when there are many
inline void quantize_rows(const c10::BFloat16* x, int64_t M, int64_t K, int64_t act_group, int64_t sum_group,
                          int8_t* act_codes, float* act_scales, float* act_sums, int32_t* code_sums,
                          int16_t* code_sums16, float* act_row_sum) {
  const int64_t act_groups = K / act_group, sum_groups = K / sum_group;
  const auto rows = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      quantize_row(x + m * K, K, act_group, act_codes + m * K, act_scales + m * act_groups);
      group_sums(act_codes + m * K, act_scales + m * act_groups, K, act_group, sum_group, act_sums + m * sum_groups,
                 code_sums + m * sum_groups, code_sums16 + m * sum_groups);
      act_row_sum[m] = 0.f;
      for (int64_t g = 0; g < sum_groups; ++g) act_row_sum[m] += act_sums[m * sum_groups + g];
    }
  };
  if (M < 2 * kQuantRowsPerTask) return rows(0, M);
  cpuserve_tasks::share_tasks((M + kQuantRowsPerTask - 1) / kQuantRowsPerTask, [&](const auto& next) {
    for (int64_t t; (t = next()) >= 0;) rows(t * kQuantRowsPerTask, std::min(M, (t + 1) * kQuantRowsPerTask));
  });
}

}  // namespace cpuserve_act
#endif
