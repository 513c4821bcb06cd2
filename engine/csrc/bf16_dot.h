// bf16 x bf16 -> fp32 products for SlimAttention (slim_attention.cpp) on CPUs with AVX512-BF16 but no AMX
// (AMD Zen 4), where torch does not offer oneDNN's bf16 brgemm (cpublas::could_pack(bf16) is false). oneDNN's
// avx512_core_bf16 brgemm does run there when called anyway, but nothing promises it; these kernels measured
// as fast (4096 tokens, one thread: 113 ms vs 117 ms; 1024: 8.4 vs 9.6 ms), near vdpbf16ps's peak.
//
// vdpbf16ps multiplies 16 bf16 pairs of A by 16 of B and adds each pair's two products into one fp32 lane. So B
// is read in the VNNI pairs layout slim_attention already packs, b[k/2][n][2] (two consecutive k of one column
// in one 32-bit word), and A one 32-bit pair a[i][2p, 2p+1] at a time, broadcast to all 16 lanes:
//
//     c[i][j .. j+15] += a[i][2p] * b[p][j .. j+15][0] + a[i][2p+1] * b[p][j .. j+15][1]     for p = 0, 1, ...
//
// A tile is R rows x 64 columns (4 vectors): R * 4 accumulators, 4 loads of B and R broadcasts per pair, so
// R = 6 keeps 24 + 4 + 1 of the 32 zmm registers busy, and each loaded B vector feeds 6 products.
//
// Every element of C is one lane summed over the pairs in increasing order, whatever the tile: its value does
// not depend on which rows share its tile, how many rows the call has, or on the other columns. This is what
// lets slim_attention promise bit-identical rows however a prompt was split.
#pragma once

#if defined(__AVX512BF16__)
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace cpuserve_bf16dot {

using bf16 = c10::BFloat16;

constexpr int64_t kTileCols = 64;  // columns of C per tile (4 vectors of 16 fp32)
constexpr int kTileRows = 6;       // rows of C per full tile

// a[0], a[1] in every lane, as the pair vdpbf16ps multiplies
inline __m512bh broadcast_pair(const bf16* a) {
  int32_t bits;
  std::memcpy(&bits, a, sizeof(bits));
  return (__m512bh)_mm512_set1_epi32(bits);
}

// lanes of columns [16 v, 16 v + 16) that are below cols
inline __mmask16 column_mask(int v, int64_t cols) {
  const int64_t n = cols - 16 * v;
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// c[R][cols] = (accumulate ? c : 0) + a[R][2 * pairs] . b[pairs][ldb][2], cols <= 64.
// a: R rows, lda elements apart; b: pair p of column j at b[(p * ldb + j) * 2]; c: R rows, ldc floats apart.
template <int R>
inline void tile(int64_t pairs, const bf16* a, int64_t lda, const bf16* b, int64_t ldb, float* c, int64_t ldc,
                 int64_t cols, bool accumulate) {
  const __mmask16 mask[4] = {column_mask(0, cols), column_mask(1, cols), column_mask(2, cols),
                             column_mask(3, cols)};
  __m512 acc[R][4];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v)
      acc[i][v] = accumulate ? _mm512_maskz_loadu_ps(mask[v], c + i * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const bf16* bp = b + p * ldb * 2;
    __m512bh bv[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) bv[v] = (__m512bh)_mm512_maskz_loadu_epi32(mask[v], bp + 32 * v);
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const __m512bh ai = broadcast_pair(a + i * lda + 2 * p);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], ai, bv[v]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) _mm512_mask_storeu_ps(c + i * ldc + 16 * v, mask[v], acc[i][v]);
}

// c[m][cols] (+)= a[m][2 * pairs] . b, one 64-column strip: full tiles of 6 rows, then one smaller tile. The
// strip of b (pairs * 256 bytes) stays in L1 while every row passes over it.
inline void gemm_strip(int64_t m, int64_t pairs, const bf16* a, int64_t lda, const bf16* b, int64_t ldb, float* c,
                       int64_t ldc, int64_t cols, bool accumulate) {
  int64_t i = 0;
  for (; i + kTileRows <= m; i += kTileRows)
    tile<kTileRows>(pairs, a + i * lda, lda, b, ldb, c + i * ldc, ldc, cols, accumulate);
  const bf16* ar = a + i * lda;
  float* cr = c + i * ldc;
  switch (m - i) {
    case 1: tile<1>(pairs, ar, lda, b, ldb, cr, ldc, cols, accumulate); break;
    case 2: tile<2>(pairs, ar, lda, b, ldb, cr, ldc, cols, accumulate); break;
    case 3: tile<3>(pairs, ar, lda, b, ldb, cr, ldc, cols, accumulate); break;
    case 4: tile<4>(pairs, ar, lda, b, ldb, cr, ldc, cols, accumulate); break;
    case 5: tile<5>(pairs, ar, lda, b, ldb, cr, ldc, cols, accumulate); break;
    default: break;
  }
}

// c[m][n] (+)= a[m][2 * pairs] . b[pairs][ldb][2], in strips of 64 columns
inline void gemm(int64_t m, int64_t n, int64_t pairs, const bf16* a, int64_t lda, const bf16* b, int64_t ldb,
                 float* c, int64_t ldc, bool accumulate) {
  for (int64_t j = 0; j < n; j += kTileCols)
    gemm_strip(m, pairs, a, lda, b + 2 * j, ldb, c + j, ldc, std::min(kTileCols, n - j), accumulate);
}

}  // namespace cpuserve_bf16dot

#endif
