// The operands of the int8 dot-product GEMMs (vnni_gemm.cpp) as they lie in memory, and how a register block
// loads them.
//
// Every width is unsigned codes (vpdpbusd's unsigned operand) times signed activations, w = code * scale + zoff:
//
//   bits 4  packed [N/16][K/8][64]: the 16 columns c of a block and inputs k0..k0+7 as 64 bytes, byte 4c + j
//           holding code(c, k0 + j) in its low nibble and code(c, k0 + 4 + j) in its high one (masking and shifting
//           one load gives two operands); codes 0..15, one scale per group along K.
//   bits 6  packed [N/16][K/16 * 3][64]: per 16 inputs k0..k0+15, two int4 rows of the codes' low nibbles (k0..k0+7,
//           then k0+8..k0+15), then 64 bytes of their top 2 bits, byte 4c + j holding those of inputs k0 + j,
//           k0 + 4 + j, k0 + 8 + j, k0 + 12 + j in bits 0-1, 2-3, 4-5, 6-7; codes 0..63 (a GGUF's Q6_K and 5-bit
//           types: 0.75 bytes per weight where 8-bit codes take 1).
//   bits 8  packed [N/16][K/4][64]: byte 4c + j = code(c, k0 + j); codes 0..255.
//   scales  [N/16][S][16] fp32 or fp16, S = K / group (per group) or 1 (per channel). At decode the kernel streams
//           codes and scales from memory: fp16 makes 32 int4 weights 20 bytes, not 24.
//   zoffs   the same shape and type, or, for symmetric codes (zoff = -z * scale everywhere: Q4_0 z = 8, Q8_0 128,
//           Q6_K 32, the engine's own int8 128), two int32 {z, e}: no zoff is stored or read, and the scales are
//           stored multiplied by 2^e (a Q6_K's small scales brought into fp16's normal range), which the output
//           divides out.
//   supers  (optional) a K-quant's factored scales, as its file stores them: supers [N/16][S/P][F][16] fp16 d and
//           -dmin per super-block of P groups, scales the uint8 / int8 sub-scales, and scale = d * sub,
//           zoff = -dmin * sub_min are formed here, exactly in fp32 (SuperScales). Symmetric types (Q3_K, Q6_K): zoffs
//           {z, 0}. With sub-mins (Q2_K, Q4_K, Q5_K: both below 64) 12 bits a group, as the file packs them: scales
//           [N/16][S][16] uint8 hold the sub-scale in bits 0-5 and the sub-min's low 2 bits in bits 6-7, zoffs
//           [N/16][S/2][16] uint8 the sub-min's high 4 bits, group 2j's in the low nibble and 2j+1's in the high one.
//           A Q4_K's 256 weights stream 144 bytes (the file's) instead of 160, a Q6_K's 210 (the file's) not 224.
#pragma once

#include <ATen/ATen.h>

#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define CPUSERVE_VNNI 1
#endif

#include <cstdint>

#if defined(CPUSERVE_VNNI)
namespace cpuserve_vnni {

using cpuserve_simd::load16;

// Every helper below sits inside the GEMMs' innermost loops. GCC 12 left some out of line at some call sites (a
// decode block's Codes<6>::load and SuperScales::scale were calls, their results passed through memory), so they
// are inlined by force, as vnni_register_blocks.h's own loop helpers are.
#define CPUSERVE_HOT inline __attribute__((always_inline))

// acc += w (unsigned bytes) . the 4 signed bytes at p, broadcast to every lane inside the instruction ({1to16}): GCC
// otherwise emits a separate vpbroadcastd per operand, one more instruction per dot product at few columns
CPUSERVE_HOT __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// acc += w (unsigned bytes) . a (signed bytes), both in registers
CPUSERVE_HOT __m512i dpbusd(__m512i acc, __m512i w, __m512i a) { return _mm512_dpbusd_epi32(acc, w, a); }

// The 4 bytes at p in every lane
CPUSERVE_HOT __m512i broadcast4(const int8_t* p) { return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p)); }

// The operands of inputs k..k+4*kOps-1 of column block `blk`'s packed stream at byte p (see the layouts above)
template <int Bits>
struct Codes {
  static constexpr int kOps = Bits == 6 ? 4 : 2;  // vpdpbusd operands (4 inputs each) per step
  static constexpr int kStep = 4 * kOps;          // inputs per step

  static CPUSERVE_HOT void load(const uint8_t* p, __m512i* w) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    if constexpr (Bits == 8) {
      w[0] = _mm512_loadu_si512(p);
      w[1] = _mm512_loadu_si512(p + 64);
    } else {
      const __m512i raw = _mm512_loadu_si512(p);
      w[0] = _mm512_and_si512(raw, low);
      w[1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
      if constexpr (Bits == 6) {
        const __m512i raw2 = _mm512_loadu_si512(p + 64), top = _mm512_loadu_si512(p + 128);
        const __m512i top_bits = _mm512_set1_epi8(0x30);
        w[2] = _mm512_and_si512(raw2, low);
        w[3] = _mm512_and_si512(_mm512_srli_epi16(raw2, 4), low);
        // each operand's 2 top bits moved to bits 4-5 of its byte (the 16-bit shifts' spill is masked off)
        const __m512i t[4] = {_mm512_slli_epi16(top, 4), _mm512_slli_epi16(top, 2), top, _mm512_srli_epi16(top, 2)};
        for (int i = 0; i < 4; ++i) w[i] = _mm512_ternarylogic_epi32(w[i], t[i], top_bits, 0xF8);  // a | (b & c)
      }
    }
  }
};

// Scales and zoffs as stored: fp32 or fp16 [N/16, S, 16] (S = 1: per channel), zo null when symmetric. b0: the
// first column block the arrays hold (0, or a tile's copy of a few blocks: vnni_column_tiles.h). A tile's copy of a
// K-quant's factored scales may also keep its integer sub-mins (SuperScales::min_pair, neg_dmin) as pairs
// [blocks, S/2, 16] and -dmin [blocks, S >> shift, 16], for the zero term's integer sums (vnni_epilogue.h zero_term).
template <typename T>
struct StoredScales {
  static constexpr bool kFactored = false;
  const T *sc, *zo;
  int64_t S, b0;
  const int32_t* pairs = nullptr;
  const float* dmin = nullptr;
  int64_t shift = 0;
  bool symmetric() const { return zo == nullptr && pairs == nullptr; }
  bool int_mins(int64_t sub) const { return pairs != nullptr && sub == int64_t{1} << shift; }
  CPUSERVE_HOT __m512 scale(int64_t b, int64_t g) const { return load16(sc + ((b - b0) * S + g) * 16); }
  CPUSERVE_HOT __m512 zoff(int64_t b, int64_t g) const { return load16(zo + ((b - b0) * S + g) * 16); }
  CPUSERVE_HOT __m512i min_pair(int64_t b, int64_t g) const {
    return _mm512_loadu_si512(pairs + ((b - b0) * (S >> 1) + (g >> 1)) * 16);
  }
  CPUSERVE_HOT __m512 neg_dmin(int64_t b, int64_t g) const {
    return _mm512_loadu_ps(dmin + ((b - b0) * (S >> shift) + (g >> shift)) * 16);
  }
};

// A K-quant's factored scales (engine/layers/linear/coded.py super_layout): scale = d * sub, zoff = -dmin * sub_min
// per group, d and -dmin fp16 per super-block of 2^shift groups. Each product is exact in fp32: the very floats of
// the file's own dequantization, from 8 or 12 bits per group and 2 or 4 bytes per super-block instead of one or two
// fp16 per group. Symmetric (no sub-mins: Q3_K, Q6_K) is part of the type, chosen once where the op builds its
// operands (int8_gemm_operands.h with_super_scales), so no loop tests it at run time.
template <typename Sub, bool Symmetric>
struct SuperScales {
  static constexpr bool kFactored = true;
  const Sub* sub;         // [N/16, S, 16] uint8 or int8; with sub-mins, their low 2 bits in bits 6-7
  const uint8_t* min_hi;  // [N/16, S/2, 16]: the sub-mins' high 4 bits, two groups a byte; null when symmetric
  const at::Half* sup;    // [N/16, S >> shift, F, 16]: d, then -dmin (F = 2) unless symmetric (F = 1)
  int64_t S, shift, F;
  static constexpr bool symmetric() { return Symmetric; }
  CPUSERVE_HOT const at::Half* super(int64_t b, int64_t g) const {
    return sup + (b * (S >> shift) + (g >> shift)) * F * 16;
  }
  CPUSERVE_HOT __m512i sub_bytes(int64_t b, int64_t g) const {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + (b * S + g) * 16)));
  }
  CPUSERVE_HOT __m512 scale(int64_t b, int64_t g) const {
    if constexpr (Symmetric) {
      return _mm512_mul_ps(load16(super(b, g)), load16(sub + (b * S + g) * 16));
    } else {
      const __m512i s = _mm512_and_si512(sub_bytes(b, g), _mm512_set1_epi32(63));
      return _mm512_mul_ps(load16(super(b, g)), _mm512_cvtepi32_ps(s));
    }
  }
  // the sub-min of group g (a 6-bit integer) in every lane
  CPUSERVE_HOT __m512i sub_min(int64_t b, int64_t g) const {
    const auto* hp = reinterpret_cast<const __m128i*>(min_hi + (b * (S >> 1) + (g >> 1)) * 16);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(hp)), 4 * (g & 1)),
                                        _mm512_set1_epi32(15));
    return _mm512_or_si512(_mm512_slli_epi32(hi, 2), _mm512_srli_epi32(sub_bytes(b, g), 6));
  }
  CPUSERVE_HOT __m512 zoff(int64_t b, int64_t g) const {
    return _mm512_mul_ps(neg_dmin(b, g), _mm512_cvtepi32_ps(sub_min(b, g)));
  }
  CPUSERVE_HOT __m512 neg_dmin(int64_t b, int64_t g) const { return load16(super(b, g) + 16); }
  // The sub-mins of groups g and g + 1 (g even) as int16 pairs, g's in the low half: vpdpwssd's operand
  CPUSERVE_HOT __m512i min_pair(int64_t b, int64_t g) const {
    return _mm512_or_si512(sub_min(b, g), _mm512_slli_epi32(sub_min(b, g + 1), 16));
  }
  // The zero term as integer sums of sub-mins and the activations' code sums per super-block of `sub` groups
  bool int_mins(int64_t sub) const { return !Symmetric && sub == int64_t{1} << shift; }
};

}  // namespace cpuserve_vnni
#endif
