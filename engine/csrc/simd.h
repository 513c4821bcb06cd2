// AVX-512 helpers shared by the kernels of engine/csrc (each kernel file includes this header).
#pragma once

#if defined(__AVX512F__)
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>

namespace cpuserve_simd {

// 16 elements as fp32 lanes (exact for each type)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// e^x: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6 Taylor (relative error < 2e-7). x is clamped below
// at -87 (e^-87 ~ 1.6e-38, still a normal float); above ~88.7 the result is +inf.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 2^x for x <= 0 (a softmax's numerators, with log2(e) folded into its scale): 2^n * p(f), f = x - n in
// [-1/2, 1/2], degree-6 Taylor of 2^f (relative error < 2e-7, as exp512's). 10 vector instructions for 16 with the
// scale, where exp512 takes 13. (A degree-4 polynomial, 5e-5, moved a tiny random Gemma 3's logits by up to 0.02
// through P's bf16 rounding: past test_gemma3's bound, where this one's stay within it.) Below x = -149 the result
// is 0 (scalef underflows); x must not be NaN or -inf.
inline __m512 exp2_neg(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.54035304e-4f);                  // ln2^6 / 720
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.33335581e-3f));  // ln2^5 / 120
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.61812911e-3f));  // ln2^4 / 24
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55041087e-2f));  // ln2^3 / 6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));  // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147181e-1f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 16 fp32 -> 16 bf16, round to nearest even (values are finite) exactly as at::BFloat16's constructor rounds,
// denormals included: what a kernel that must match torch's bits stores
inline __m256i to_bf16_exact(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// 16 fp32 lanes stored as float, or as bf16 rounded exactly as at::BFloat16's constructor (store<T> of the kernels)
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_exact(x));
}

}  // namespace cpuserve_simd

#endif
