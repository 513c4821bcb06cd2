// Dynamic int8 activations for the int8 dot-product GEMMs (vnni_gemm.cpp).
//
// Each row of x is quantized on its own, symmetrically, one scale per `act_group` inputs (act_group = K: one per
// row): s = absmax / 127, q = round-half-even(x * (127 / absmax)), so x ~= s * q with q in [-127, 127]. A row's
// codes and scales depend on that row alone, never on the batch it shares or the thread that quantizes it.
//
// Each group also gets the sum of its codes and axs = scale * that sum, for the weights' zero points (vnni_gemm.cpp).
// engine/layers/linear/act_int8.py's quantize_rows is the plain-torch reference.
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
// activation group spans several): qs[g] = the sum of the row's codes in g; axs[g] = scale * qs[g] when g is an
// activation group, else qs[g] as a float (the kernel multiplies by the activation's scale after the weight groups);
// qs16 (optional) [g] = qs[g] as int16, which holds it for groups of up to 256 inputs (used only there).
inline void group_sums(const int8_t* q, const float* scale, int64_t K, int64_t act_group, int64_t sum_group,
                       float* axs, int32_t* qs, int16_t* qs16 = nullptr) {
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += sum_group, ++g) {
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = g0; k < g0 + sum_group; k += 16)
      sum = _mm512_add_epi32(sum, _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k))));
    qs[g] = _mm512_reduce_add_epi32(sum);
    if (qs16) qs16[g] = static_cast<int16_t>(qs[g]);
    axs[g] = (sum_group == act_group ? scale[g] : 1.f) * static_cast<float>(qs[g]);
  }
}

}  // namespace cpuserve_act

#endif
