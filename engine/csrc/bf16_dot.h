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
// in register_tile.h's tiles: every element of C is one lane summed over the pairs in increasing order, whatever the
// tile, so its value does not depend on which rows share its tile, how many rows the call has, or on the other
// columns.
#pragma once

#if defined(__AVX512BF16__)
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include "register_tile.h"

#include <cstdint>
#include <cstring>

namespace cpuserve_bf16dot {

using bf16 = c10::BFloat16;

// register_tile.h's step: one bf16 pair of A times 16 pairs of B
struct PairStep {
  using A = bf16;
  using B = bf16;
  using In = __m512bh;
  static constexpr int64_t kPack = 2;
  static In broadcast(const bf16* a) {  // a[0], a[1] in every lane, as the pair vdpbf16ps multiplies
    int32_t bits;
    std::memcpy(&bits, a, sizeof(bits));
    return (__m512bh)_mm512_set1_epi32(bits);
  }
  static In load(const bf16* b, __mmask16 mask) { return (__m512bh)_mm512_maskz_loadu_epi32(mask, b); }
  static __m512 mac(In a, In b, __m512 acc) { return _mm512_dpbf16_ps(acc, a, b); }
};

// c[m][n] (+)= a[m][2 * pairs] . b[pairs][ldb][2], in strips of 64 columns
inline void gemm(int64_t m, int64_t n, int64_t pairs, const bf16* a, int64_t lda, const bf16* b, int64_t ldb,
                 float* c, int64_t ldc, bool accumulate) {
  cpuserve_tile::gemm<PairStep>(m, n, pairs, a, lda, b, ldb, c, ldc, accumulate);
}

}  // namespace cpuserve_bf16dot

#endif
