// What SlimAttention's two kernels share (slim_attention.cpp: bf16, slim_attention_fp32.cpp: fp32): K^T packed per
// key block, a score row's max, its softmax numerators and their sum. Each depends on the row's own scores and its
// own range of keys alone, so a row's result never depends on the rows it was computed with.
#pragma once

#include <ATen/ATen.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace cpuserve_slim {

constexpr int64_t kKeyBlock = 256;  // keys per packed block (N of one Q K^T product)

// max of s[0, n), starting from mx
inline float row_max(const float* s, int64_t n, float mx) {
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 vmax = _mm512_set1_ps(mx);
  for (; t + 16 <= n; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + t));
  mx = _mm512_reduce_max_ps(vmax);
#endif
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  return mx;
}

// p[0, valid) = exp(scale * (s - mx)), zero on [valid, n), where mx is the max of s[0, valid); returns 1 / the sum of
// the fp32 exponentials, by which the row's P V is scaled at the end (one pass over the scores less than normalizing
// P itself). exp2_neg with log2(e) folded into the scale: three instructions fewer for 16 scores than exp512 after a
// multiply. P is bf16 or fp32; store(p, e, live) writes the lanes of e in live to p[0, 16) as P. p may be s: each
// score is read before its numerator is written.
template <typename P, typename Store>
float softmax_row(const float* s, int64_t valid, int64_t n, float mx, float scale, P* p, const Store& store) {
  int64_t t = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  using cpuserve_simd::exp2_neg;
  const float scale2 = scale * 1.44269504f;  // exp(scale * d) = 2^(scale2 * d)
  const __m512 vshift = _mm512_set1_ps(-mx * scale2), vscale = _mm512_set1_ps(scale2);
  __m512 vsum0 = _mm512_setzero_ps(), vsum1 = _mm512_setzero_ps();  // two sums: the adds do not wait on each other
  for (t = 0; t + 32 <= valid; t += 32) {
    const __m512 e0 = exp2_neg(_mm512_fmadd_ps(_mm512_loadu_ps(s + t), vscale, vshift));
    const __m512 e1 = exp2_neg(_mm512_fmadd_ps(_mm512_loadu_ps(s + t + 16), vscale, vshift));
    store(p + t, e0, __mmask16(0xFFFF));
    store(p + t + 16, e1, __mmask16(0xFFFF));
    vsum0 = _mm512_add_ps(vsum0, e0);
    vsum1 = _mm512_add_ps(vsum1, e1);
  }
  for (; t < valid; t += 16) {  // the last 1..31 scores, 16 lanes at a time; lanes past valid are zero
    const __mmask16 live = valid - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (valid - t)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(live, exp2_neg(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, s + t), vscale,
                                                                         vshift)));
    store(p + t, e, live);
    vsum0 = _mm512_add_ps(vsum0, e);
  }
  sum = _mm512_reduce_add_ps(_mm512_add_ps(vsum0, vsum1));
  t = valid;
#endif
  for (; t < valid; ++t) {
    const float e = std::exp((s[t] - mx) * scale);
    p[t] = static_cast<P>(e);
    sum += e;
  }
  std::fill(p + valid, p + n, P(0.f));
  return 1.f / sum;
}

// One key block of a kv head as K^T in 32-bit words: dst[p][t] = word p of key t ^ flip for t < n, zero for
// n <= t < kKeyBlock, where key t's words start at src + t * ld_words words. A bf16 key's word is a VNNI pair
// (d, d+1); an int8 key's 4 consecutive dims, flipped by 0x80808080 to code + 128 (int8_scores.h); an fp32 key's
// word is one dim. Sixteen keys' words gathered per store.
inline void pack_keys(const void* src, int64_t ld_words, int64_t n, int64_t words, uint32_t flip, uint32_t* dst) {
  const auto* in = static_cast<const uint32_t*>(src);
#if defined(__AVX512F__)
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int>(ld_words)));
  const __m512i vflip = _mm512_set1_epi32(static_cast<int>(flip));
  for (int64_t p = 0; p < words; ++p)
    for (int64_t t = 0; t < kKeyBlock; t += 16) {
      const __mmask16 live = t >= n ? 0 : n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
      const __m512i gathered = live ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows,
                                                                   in + t * ld_words + p, 4)
                                    : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + p * kKeyBlock + t, _mm512_maskz_xor_epi32(live, gathered, vflip));
    }
#else
  for (int64_t p = 0; p < words; ++p)
    for (int64_t t = 0; t < kKeyBlock; ++t) dst[p * kKeyBlock + t] = t < n ? in[t * ld_words + p] ^ flip : 0u;
#endif
}

// The fp32 kernel (slim_attention_fp32.cpp), which slim_attention dispatches fp32 q, k and v to: the same contract
// and arguments, without an int8 K. Refuses where fp32_supported() is false.
at::Tensor slim_attention_fp32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t q_start,
                               double sm_scale, int64_t block_rows, int64_t window);

// The fp32 kernel is built: this level has AVX-512 (elsewhere the engine runs attention.py's plain-torch path)
bool fp32_supported();

}  // namespace cpuserve_slim
