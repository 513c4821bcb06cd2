// The register tile both SlimAttention product kernels run (bf16_dot.h: vdpbf16ps on bf16 pairs, fp32_dot.h: fma on
// fp32), given a Step that says what one step over k loads and multiplies:
//
//     c[i][j .. j+15] += A's step p of row i (broadcast to all 16 lanes) . B's step p of columns j .. j+15
//
// A tile is R rows x 64 columns (4 vectors): R * 4 accumulators, 4 loads of B and R broadcasts per step, so R = 6
// keeps 24 + 4 + 1 of the 32 zmm registers busy, and each loaded B vector feeds 6 products.
//
// Every element of C is one lane advanced over the steps in increasing order (from 0, or from c with accumulate),
// whatever the tile: its value does not depend on which rows share its tile, how many rows the call has, or on the
// other columns. This is what lets slim_attention promise bit-identical rows however a prompt was split.
//
// A Step has: A, B (element types), In (a vector operand), kPack (elements of a row of A per step: B's row p holds
// kPack consecutive k of each column side by side), broadcast(a) (A's step at a, in every lane) and load(b, mask)
// (16 columns of B's step at b, zero past mask), mac(a, b, acc).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace cpuserve_tile {

constexpr int64_t kTileCols = 64;  // columns of C per tile (4 vectors of 16 fp32)
constexpr int kTileRows = 6;       // rows of C per full tile

// lanes of columns [16 v, 16 v + 16) that are below cols
inline __mmask16 column_mask(int v, int64_t cols) {
  const int64_t n = cols - 16 * v;
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// c[R][cols] = (accumulate ? c : 0) + a[R][kPack * steps] . b[steps][ldb][kPack], cols <= 64.
// a: R rows, lda elements apart; b: step p of column j at b[(p * ldb + j) * kPack]; c: R rows, ldc floats apart.
template <typename Step, int R>
inline void tile(int64_t steps, const typename Step::A* a, int64_t lda, const typename Step::B* b, int64_t ldb,
                 float* c, int64_t ldc, int64_t cols, bool accumulate) {
  const __mmask16 mask[4] = {column_mask(0, cols), column_mask(1, cols), column_mask(2, cols),
                             column_mask(3, cols)};
  __m512 acc[R][4];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v)
      acc[i][v] = accumulate ? _mm512_maskz_loadu_ps(mask[v], c + i * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t p = 0; p < steps; ++p) {
    const typename Step::B* bp = b + p * ldb * Step::kPack;
    typename Step::In bv[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) bv[v] = Step::load(bp + 16 * Step::kPack * v, mask[v]);
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const typename Step::In ai = Step::broadcast(a + i * lda + Step::kPack * p);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) acc[i][v] = Step::mac(ai, bv[v], acc[i][v]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) _mm512_mask_storeu_ps(c + i * ldc + 16 * v, mask[v], acc[i][v]);
}

// c[m][cols] (+)= a . b, one 64-column strip: full tiles of 6 rows, then one smaller tile. The strip of b stays in
// L1 while every row passes over it.
template <typename Step>
inline void gemm_strip(int64_t m, int64_t steps, const typename Step::A* a, int64_t lda, const typename Step::B* b,
                       int64_t ldb, float* c, int64_t ldc, int64_t cols, bool accumulate) {
  int64_t i = 0;
  for (; i + kTileRows <= m; i += kTileRows)
    tile<Step, kTileRows>(steps, a + i * lda, lda, b, ldb, c + i * ldc, ldc, cols, accumulate);
  const typename Step::A* ar = a + i * lda;
  float* cr = c + i * ldc;
  switch (m - i) {
    case 1: tile<Step, 1>(steps, ar, lda, b, ldb, cr, ldc, cols, accumulate); break;
    case 2: tile<Step, 2>(steps, ar, lda, b, ldb, cr, ldc, cols, accumulate); break;
    case 3: tile<Step, 3>(steps, ar, lda, b, ldb, cr, ldc, cols, accumulate); break;
    case 4: tile<Step, 4>(steps, ar, lda, b, ldb, cr, ldc, cols, accumulate); break;
    case 5: tile<Step, 5>(steps, ar, lda, b, ldb, cr, ldc, cols, accumulate); break;
    default: break;
  }
}

// c[m][n] (+)= a[m][kPack * steps] . b[steps][ldb][kPack], in strips of 64 columns
template <typename Step>
inline void gemm(int64_t m, int64_t n, int64_t steps, const typename Step::A* a, int64_t lda,
                 const typename Step::B* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  for (int64_t j = 0; j < n; j += kTileCols)
    gemm_strip<Step>(m, steps, a, lda, b + Step::kPack * j, ldb, c + j, ldc, std::min(kTileCols, n - j), accumulate);
}

}  // namespace cpuserve_tile

#endif
