// SlimAttention's Q K^T as int8 dot products (slim_attention.cpp), where its products run on avx512_bf16 (AMD Zen 4,
// Intel CPUs without AMX): vpdpbusd does 64 multiply-adds an instruction where vdpbf16ps does 32.
//
// K comes straight from the int8 KV pool, k ~= sk[t] * kc[t] (kv_quant.py: one scale per token and kv head), so its
// codes are those decode reads. Each query row (one token, one head) is quantized on its own as the GEMMs'
// activations are (act_quant.h), one scale per kQGroup dims: q ~= sq[g] * qc over group g. Then
//
//     score[i][t] = sk[t] * sum_g sq[i][g] * float(sum_{d in g} qc[i][d] * kc[t][d])
//
// with each group's integer sum exact. (One scale for a head's 64 dims moved SmolLM2's softmax rows by 0.059 in L1 on
// average, groups of 32 by 0.038: its q has a few large dims.) vpdpbusd multiplies unsigned bytes by signed ones,
// so the keys are packed as kc + 128 (unsigned); what that adds, 128 * sum_g sq[i][g] * sum_{d in g} qc[i][d], is
// the same for every key of row i and is taken off once (start[i]). Each score is the same instructions in the
// same order whatever the tile, the rows sharing it or the threads: a row's scores depend on that row and the keys.
//
// Packed keys, one block of `block` keys (slim_attention.cpp's pack_keys): u8 [D/4][block][4] (4 consecutive dims of
// one key a 32-bit word), zero codes and scales past the last key. engine/layers/attention.py's slim_attention is
// the plain-torch reference.
#pragma once

#include "vnni_layouts.h"

#include <algorithm>
#include <cstdint>

namespace cpuserve_int8_scores {

constexpr int64_t kQGroup = 32;  // query dims per scale (engine/layers/attention.py's Q_GROUP)

}  // namespace cpuserve_int8_scores

#if defined(CPUSERVE_VNNI)
namespace cpuserve_int8_scores {

constexpr int64_t kTileCols = 64;  // keys per tile (4 vectors of 16)
constexpr int kTileRows = 3;       // query rows per full tile

inline __mmask16 column_mask(int v, int64_t cols) {
  const int64_t n = cols - 16 * v;
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// s[R][cols] = (sum_g qs[g] * float(a_g . b_g) + start) * sk, cols <= 64: a R rows of codes lda apart, qs their
// group scales (G a row), start[i] row i's offset; b the packed block's words from this tile's first key, ldb keys
// apart. Three rows: 12 integer sums, 12 fp32 ones, 4 keys' words and one broadcast in the 32 registers.
template <int R>
inline void tile(int64_t D, const int8_t* a, int64_t lda, const float* qs, const float* start, const uint8_t* b,
                 int64_t ldb, const float* sk, float* s, int64_t lds, int64_t cols) {
  const __mmask16 mask[4] = {column_mask(0, cols), column_mask(1, cols), column_mask(2, cols), column_mask(3, cols)};
  const int64_t G = D / kQGroup;
  __m512 y[R][4];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < 4; ++v) y[i][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[R][4];
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int step = 0; step < kQGroup / 4; ++step) {  // a fixed count: unrolled whole, no remainder to dispatch
      const int64_t p = g * kQGroup / 4 + step;
      const auto* bp = reinterpret_cast<const uint32_t*>(b) + p * ldb;
      __m512i bv[4];
      for (int v = 0; v < 4; ++v) bv[v] = _mm512_maskz_loadu_epi32(mask[v], bp + 16 * v);
      for (int i = 0; i < R; ++i) {
        const __m512i ai = cpuserve_vnni::broadcast4(a + i * lda + 4 * p);
        for (int v = 0; v < 4; ++v) acc[i][v] = cpuserve_vnni::dpbusd(acc[i][v], bv[v], ai);
      }
    }
    for (int i = 0; i < R; ++i) {
      const __m512 sq = _mm512_set1_ps(qs[i * G + g]);
      for (int v = 0; v < 4; ++v) y[i][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][v]), sq, y[i][v]);
    }
  }
  // the start added last, not as the sums' first value: GCC then gave a row's 4 sums one register between them and
  // kept the rest on the stack (loaded and stored around every vpdpbusd)
  for (int i = 0; i < R; ++i) {
    const __m512 row_start = _mm512_set1_ps(start[i]);
    for (int v = 0; v < 4; ++v) {
      const __m512 key_scale = _mm512_maskz_loadu_ps(mask[v], sk + 16 * v);
      _mm512_mask_storeu_ps(s + i * lds + 16 * v, mask[v], _mm512_mul_ps(_mm512_add_ps(y[i][v], row_start), key_scale));
    }
  }
}

// s[m][n] = scores of m query rows (codes a [m][D], group scales qs [m][D / kQGroup], offsets start [m]) against the
// first n keys of one packed block (n <= its length `block`), in strips of 64 keys: full tiles of 3 rows, then one
// smaller tile
inline void scores(int64_t m, int64_t n, int64_t D, const int8_t* a, const float* qs, const float* start,
                   const uint8_t* b, int64_t block, const float* sk, float* s, int64_t lds) {
  const int64_t G = D / kQGroup;
  for (int64_t j = 0; j < n; j += kTileCols) {
    const int64_t cols = std::min(kTileCols, n - j);
    const uint8_t* bj = b + 4 * j;
    int64_t i = 0;
    for (; i + kTileRows <= m; i += kTileRows)
      tile<kTileRows>(D, a + i * D, D, qs + i * G, start + i, bj, block, sk + j, s + i * lds + j, lds, cols);
    if (m - i == 2) tile<2>(D, a + i * D, D, qs + i * G, start + i, bj, block, sk + j, s + i * lds + j, lds, cols);
    if (m - i == 1) tile<1>(D, a + i * D, D, qs + i * G, start + i, bj, block, sk + j, s + i * lds + j, lds, cols);
  }
}

}  // namespace cpuserve_int8_scores

#endif
