// fp32 products for SlimAttention's fp32 kernel (slim_attention_fp32.cpp): c[m][n] (+)= a[m][k] . b[k][n] on AVX-512
// FMA. B is read by rows (K^T packed per key block for Q K^T, V as it lies for P V), A one element at a time,
// broadcast to all 16 lanes:
//
//     c[i][j .. j+15] += a[i][p] * b[p][j .. j+15]     for p = 0, 1, ...
//
// in register_tile.h's tiles: every element of C is one chain of fused multiply-adds over p in increasing order,
// whatever the tile, so its value does not depend on which rows share its tile, how many rows the call has, or on
// the other columns; and a term a = +0 leaves it as it was (b finite).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include "register_tile.h"

#include <cstdint>

namespace cpuserve_fp32dot {

// register_tile.h's step: one float of A times 16 of B
struct FloatStep {
  using A = float;
  using B = float;
  using In = __m512;
  static constexpr int64_t kPack = 1;
  static In broadcast(const float* a) { return _mm512_set1_ps(*a); }
  static In load(const float* b, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, b); }
  static __m512 mac(In a, In b, __m512 acc) { return _mm512_fmadd_ps(a, b, acc); }
};

// c[m][n] (+)= a[m][k] . b[k][ldb], in strips of 64 columns
inline void gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                 int64_t ldc, bool accumulate) {
  cpuserve_tile::gemm<FloatStep>(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
}

}  // namespace cpuserve_fp32dot

#endif
