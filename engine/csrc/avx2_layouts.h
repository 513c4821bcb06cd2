// The int8 dot-product GEMMs' operands (vnni_layouts.h has their layouts) as the AVX2 build loads them
// (avx2_gemm.h): a column block's 16 columns as two halves of 8 lanes, columns 8h..8h+7 in half h, which the
// layouts keep as the first and the second 32 bytes of each 64.
//
// Products of unsigned codes and signed activation codes, summed exactly into int32 either way:
//   AVX-VNNI  vpdpbusd on 8 lanes (Alder Lake and later cores, Sierra Forest): 4 byte pairs a lane, as AVX-512's
//   AVX2      vpmaddubsw sums 2 byte pairs into int16 with saturation, then vpmaddwd by ones 2 int16 into int32.
//             Exact while a pair sum and what is added to it in int16 stay below 2^15:
//               4-bit codes  2 x 15 x 127 = 3810 a pair: 8 of them (a chunk of 32 inputs) sum in int16 (30480)
//               6-bit codes  2 x 63 x 127 = 16002 a pair: 2 of them
//               8-bit codes  2 x 255 x 127 would saturate: the codes are taken as signed bytes w = code - 128
//                            (|w| <= 128) and each product as |w| x (q with w's sign) (llama.cpp's mul_sum_i8_pairs),
//                            2 x 128 x 127 = 32512 a pair; the sum is then of w q, so the GEMM adds 128 x sum q
#pragma once

#include <ATen/ATen.h>

// The AVX2 build's GEMMs: AVX2 with FMA and F16C, and no AVX-512 VNNI (whose build has vnni_layouts.h's)
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && \
    !(defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__))
#define CPUSERVE_AVX2_GEMM 1
#endif

#if defined(CPUSERVE_AVX2_GEMM)
#include <immintrin.h>

#include <cstdint>

namespace cpuserve_avx2 {

#if defined(__AVXVNNI__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

#define CPUSERVE_HOT inline __attribute__((always_inline))

// The 4 bytes at p in every lane
CPUSERVE_HOT __m256i broadcast4(const int8_t* p) { return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(p)); }

// 8 elements as fp32 lanes (exact for each type)
CPUSERVE_HOT __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
CPUSERVE_HOT __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
CPUSERVE_HOT __m256i load8_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
CPUSERVE_HOT __m256 load8(const uint8_t* p) { return _mm256_cvtepi32_ps(load8_u8(p)); }
CPUSERVE_HOT __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// 8 fp32 -> 8 bf16, round to nearest even as at::BFloat16's constructor rounds (values are finite):
// simd.h's to_bf16_exact on 8 lanes
CPUSERVE_HOT __m128i to_bf16(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  // packus works per 128-bit lane: lanes 0-3 and 4-7 land in quarters 0 and 2
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packus_epi32(top, top), 0xD8);
  return _mm256_castsi256_si128(words);
}

// The operands of half h (columns 8h..8h+7) of one step of a column block's packed stream at byte p: kOps
// operands of 4 inputs each, kStep inputs, kBytes bytes a step (both halves)
template <int Bits>
struct Codes;

template <>
struct Codes<4> {  // inputs k0..k0+3 in the low nibbles, k0+4..k0+7 in the high ones
  static constexpr int kOps = 2, kStep = 8, kBytes = 64;
  static CPUSERVE_HOT void load(const uint8_t* p, int h, __m256i* w) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
    const __m256i low = _mm256_set1_epi8(0x0F);
    w[0] = _mm256_and_si256(raw, low);
    w[1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
  }
};

template <>
struct Codes<6> {  // two rows of low nibbles (k0..k0+7, k0+8..k0+15), then the top 2 bits of all 16
  static constexpr int kOps = 4, kStep = 16, kBytes = 192;
  static CPUSERVE_HOT void load(const uint8_t* p, int h, __m256i* w) {
    Codes<4>::load(p, h, w);
    Codes<4>::load(p + 64, h, w + 2);
    const __m256i top = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
    const __m256i top_bits = _mm256_set1_epi8(0x30);
    // operand i's 2 top bits (bits 2i, 2i+1 of its byte) moved to bits 4-5 (the 16-bit shifts' spill is masked off)
    const __m256i t[4] = {_mm256_slli_epi16(top, 4), _mm256_slli_epi16(top, 2), top, _mm256_srli_epi16(top, 2)};
    for (int i = 0; i < 4; ++i) w[i] = _mm256_or_si256(w[i], _mm256_and_si256(t[i], top_bits));
  }
};

template <>
struct Codes<8> {  // one byte a code; without AVX-VNNI as signed bytes code - 128
  static constexpr int kOps = 1, kStep = 4, kBytes = 64;
  static CPUSERVE_HOT void load(const uint8_t* p, int h, __m256i* w) {
    w[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
    if constexpr (!kVnni) w[0] = _mm256_xor_si256(w[0], _mm256_set1_epi8(static_cast<char>(0x80)));
  }
};

// Scales and zoffs as stored: fp32 or fp16 [N/16, S, 16] (S = 1: per channel), zo null when symmetric; sc and zo
// start at column block b0 (vnni_layouts.h's)
template <typename T>
struct StoredScales {
  static constexpr bool kFactored = false;
  const T *sc, *zo;
  int64_t S, b0;
  bool symmetric() const { return zo == nullptr; }
  bool int_mins(int64_t) const { return false; }
  CPUSERVE_HOT __m256 scale(int64_t b, int64_t g, int h) const { return load8(sc + ((b - b0) * S + g) * 16 + 8 * h); }
  CPUSERVE_HOT __m256 zoff(int64_t b, int64_t g, int h) const { return load8(zo + ((b - b0) * S + g) * 16 + 8 * h); }
  CPUSERVE_HOT __m256 neg_dmin(int64_t, int64_t, int) const { return _mm256_setzero_ps(); }
  CPUSERVE_HOT __m256i min_pair(int64_t, int64_t, int) const { return _mm256_setzero_si256(); }
};

// A K-quant's factored scales (vnni_layouts.h SuperScales): scale = d * sub, zoff = -dmin * sub_min, each product
// exact in fp32, the same floats as the AVX-512 build's; Symmetric: no sub-mins, as there
template <typename Sub, bool Symmetric>
struct SuperScales {
  static constexpr bool kFactored = true;
  const Sub* sub;         // [N/16, S, 16]; with sub-mins, their low 2 bits in bits 6-7
  const uint8_t* min_hi;  // [N/16, S/2, 16]: the sub-mins' high 4 bits; null when symmetric
  const at::Half* sup;    // [N/16, S >> shift, F, 16]: d, then -dmin (F = 2) unless symmetric
  int64_t S, shift, F;
  static constexpr bool symmetric() { return Symmetric; }
  bool int_mins(int64_t sub_groups) const { return !Symmetric && sub_groups == int64_t{1} << shift; }
  CPUSERVE_HOT const at::Half* super(int64_t b, int64_t g, int h) const {
    return sup + (b * (S >> shift) + (g >> shift)) * F * 16 + 8 * h;
  }
  CPUSERVE_HOT __m256i sub_bytes(int64_t b, int64_t g, int h) const {
    return load8_u8(reinterpret_cast<const uint8_t*>(sub) + (b * S + g) * 16 + 8 * h);
  }
  CPUSERVE_HOT __m256 scale(int64_t b, int64_t g, int h) const {
    if constexpr (Symmetric) {
      return _mm256_mul_ps(load8(super(b, g, h)), load8(sub + (b * S + g) * 16 + 8 * h));
    } else {
      const __m256i s = _mm256_and_si256(sub_bytes(b, g, h), _mm256_set1_epi32(63));
      return _mm256_mul_ps(load8(super(b, g, h)), _mm256_cvtepi32_ps(s));
    }
  }
  // the sub-min of group g (a 6-bit integer) in every lane
  CPUSERVE_HOT __m256i sub_min(int64_t b, int64_t g, int h) const {
    const __m256i packed = load8_u8(min_hi + (b * (S >> 1) + (g >> 1)) * 16 + 8 * h);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(packed, 4 * (g & 1)), _mm256_set1_epi32(15));
    return _mm256_or_si256(_mm256_slli_epi32(hi, 2), _mm256_srli_epi32(sub_bytes(b, g, h), 6));
  }
  CPUSERVE_HOT __m256 neg_dmin(int64_t b, int64_t g, int h) const { return load8(super(b, g, h) + 16); }
  CPUSERVE_HOT __m256 zoff(int64_t b, int64_t g, int h) const {
    return _mm256_mul_ps(neg_dmin(b, g, h), _mm256_cvtepi32_ps(sub_min(b, g, h)));
  }
  // The sub-mins of groups g and g + 1 (g even) as int16 pairs, g's in the low half: vpmaddwd's operand
  CPUSERVE_HOT __m256i min_pair(int64_t b, int64_t g, int h) const {
    return _mm256_or_si256(sub_min(b, g, h), _mm256_slli_epi32(sub_min(b, g + 1, h), 16));
  }
};

}  // namespace cpuserve_avx2
#endif
