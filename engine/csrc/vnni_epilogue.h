// The int8 dot-product GEMMs' fp32 epilogue on AVX-512: a group's exact int32 sums of R rows x C column blocks into
// the rows' fp32 sums y, and y into bf16 out. The register blocks (vnni_register_blocks.h) and the AMX tiles
// (vnni_amx_rows.h) both run it, so each output element gets the same instructions in the same order (groups in k
// order) whatever made its integer sums: a row's result depends neither on the batch, the tiling nor the threads.
//
// Per activation group g (act_group inputs; x ~= act_scales[g] * q, act_sums[g] = act_scales[g] * code_sums[g]):
//     y += float(sum code * q) * scale * act_scales[g] + zoff * act_sums[g]             (zoffs stored)
//     y += float(sum code * q - z * code_sums[g]) * (scale * act_scales[g])            (symmetric: exact integer sum)
// With one scale per output channel the weights' terms come out of the sum: per group only
//     y' += float(sum code * q) * act_scales[g],   then once   y = y' * scale + zoff * act_row_sum.
// vpdpbusd and the fp32 multiplies share Zen 4's two 512-bit pipes (measured: 8 vpdpbusd + 4 FMAs take 12 cycles),
// so every epilogue instruction saved per group is a dot product gained: the per-group form costs 3 of them per 8
// vpdpbusd (int4, groups of 32), the symmetric form 2 (the zero term starts the integer sum), the per-channel form 1,
// where an activation group spans several weight groups (a K-quant's super-block: nested) 2 or 1, and per-channel
// weights with one activation group a row (act_group = K: activations "int8-token", vLLM's W8A8 scheme) none: the
// integer sum runs over all of K, then one epilogue (int32 holds it: |sum| <= 255 * 127 * K).
#pragma once

#include "int8_gemm_operands.h"
#include "simd.h"
#include "vnni_layouts.h"

#include <cstdint>

#if defined(CPUSERVE_VNNI)
namespace cpuserve_vnni {

using cpuserve_int8::GemmOperands;

// The form with a group per activation group (act_group inputs, the weights' group too unless per channel), group
// g of rows m..m+R-1 and column blocks b..b+C-1: y += its integer sums times the activation scale (per channel) or
// the two scales, plus its zero term unless symmetric
template <int R, int C, typename Scales>
CPUSERVE_HOT void group_terms(const GemmOperands<Scales>& gemm, __m512 (&y)[R][C], const __m512i (&acc)[R][C],
                              int64_t m, int64_t g, int64_t b, bool per_channel, bool symmetric) {
  const int64_t act_groups = gemm.num_act_groups();
  if (per_channel) {
    for (int r = 0; r < R; ++r) {
      const __m512 act_scale = _mm512_set1_ps(gemm.act_scales[(m + r) * act_groups + g]);
      for (int c = 0; c < C; ++c) y[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), act_scale, y[r][c]);
    }
    return;
  }
  for (int c = 0; c < C; ++c) {  // the weights' group g (act_group = group)
    const __m512 scale = gemm.scales.scale(b + c, g);
    if (symmetric) {
      for (int r = 0; r < R; ++r) {
        const __m512 both = _mm512_mul_ps(scale, _mm512_set1_ps(gemm.act_scales[(m + r) * act_groups + g]));
        y[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), both, y[r][c]);
      }
      continue;
    }
    const __m512 zoff = gemm.scales.zoff(b + c, g);
    for (int r = 0; r < R; ++r) {
      const __m512 both = _mm512_mul_ps(scale, _mm512_set1_ps(gemm.act_scales[(m + r) * act_groups + g]));
      y[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), both, y[r][c]);
      y[r][c] = _mm512_fmadd_ps(zoff, _mm512_set1_ps(gemm.act_sums[(m + r) * act_groups + g]), y[r][c]);
    }
  }
}

// The per-channel form's tail, after every group: y times each channel's scale, plus its zero term unless symmetric
template <int R, int C, typename Scales>
CPUSERVE_HOT void channel_terms(const GemmOperands<Scales>& gemm, __m512 (&y)[R][C], int64_t m, int64_t b,
                                bool symmetric) {
  for (int c = 0; c < C; ++c) {
    const __m512 scale = gemm.scales.scale(b + c, 0);
    if (symmetric) {
      for (int r = 0; r < R; ++r) y[r][c] = _mm512_mul_ps(y[r][c], scale);
      continue;
    }
    const __m512 zoff = gemm.scales.zoff(b + c, 0);
    for (int r = 0; r < R; ++r)
      y[r][c] = _mm512_fmadd_ps(y[r][c], scale, _mm512_mul_ps(zoff, _mm512_set1_ps(gemm.act_row_sum[m + r])));
  }
}

// The nested form's weight group g: act_group_sum += its integer sums times its scales, plus its zero term unless
// there is none or zero_term takes it
template <int R, int C, typename Scales>
CPUSERVE_HOT void weight_group_terms(const GemmOperands<Scales>& gemm, __m512 (&act_group_sum)[R][C],
                                     const __m512i (&acc)[R][C], int64_t m, int64_t g, int64_t b, bool no_zoff) {
  for (int c = 0; c < C; ++c) {
    const __m512 scale = gemm.scales.scale(b + c, g);
    for (int r = 0; r < R; ++r)
      act_group_sum[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), scale, act_group_sum[r][c]);
    if (no_zoff) continue;
    const __m512 zoff = gemm.scales.zoff(b + c, g);
    for (int r = 0; r < R; ++r)
      act_group_sum[r][c] = _mm512_fmadd_ps(
          zoff, _mm512_set1_ps(gemm.act_sums[(m + r) * gemm.num_weight_groups + g]), act_group_sum[r][c]);
  }
}

// act_group_sum[r][c] += -dmin * the sum over weight groups g0..g0+count-1 of sub_min(c, g) * code_sums(r, g): exact
// int32 sums (a sub-min below 64, a group's code sum within +-kInt16Group * 127), then one multiply. Q4_K's 8 groups:
// 4 vpdpwssd and 1 multiply where the zero term per group took 8 multiplies.
template <int R, int C, typename Scales>
CPUSERVE_HOT void zero_term(const GemmOperands<Scales>& gemm, __m512 (&act_group_sum)[R][C], int64_t m, int64_t g0,
                            int64_t count, int64_t b) {
  __m512i min_sums[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) min_sums[r][c] = _mm512_setzero_si512();
  for (int64_t g = g0; g < g0 + count; g += 2)
    for (int c = 0; c < C; ++c) {
      const __m512i mins = gemm.scales.min_pair(b + c, g);
      for (int r = 0; r < R; ++r) {  // g's and g + 1's code sums
        const auto* pair = gemm.code_sums16 + (m + r) * gemm.num_weight_groups + g;
        min_sums[r][c] = _mm512_dpwssd_epi32(min_sums[r][c], mins, broadcast4(reinterpret_cast<const int8_t*>(pair)));
      }
    }
  for (int c = 0; c < C; ++c) {
    const __m512 neg_dmin = gemm.scales.neg_dmin(b + c, g0);
    for (int r = 0; r < R; ++r)
      act_group_sum[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(min_sums[r][c]), neg_dmin, act_group_sum[r][c]);
  }
}

// The nested form's activation group a (its weight groups' terms in act_group_sum): y += act_group_sum times its
// scale
template <int R, int C, typename Scales>
CPUSERVE_HOT void activation_group_terms(const GemmOperands<Scales>& gemm, __m512 (&y)[R][C],
                                         __m512 (&act_group_sum)[R][C], int64_t m, int64_t a, int64_t b,
                                         bool int_zero_term) {
  const int64_t act_groups = gemm.num_act_groups(), per_act_group = gemm.weight_groups_per_act_group();
  if (int_zero_term) zero_term<R, C>(gemm, act_group_sum, m, a * per_act_group, per_act_group, b);
  for (int r = 0; r < R; ++r) {
    const __m512 act_scale = _mm512_set1_ps(gemm.act_scales[(m + r) * act_groups + a]);
    for (int c = 0; c < C; ++c) y[r][c] = _mm512_fmadd_ps(act_group_sum[r][c], act_scale, y[r][c]);
  }
}

// y of rows m..m+R-1 and column blocks b..b+C-1 into out as bf16 (the symmetric form's 2^-e divided out first)
template <int R, int C, typename Scales>
CPUSERVE_HOT void store(const GemmOperands<Scales>& gemm, int64_t m, int64_t b, __m512 (&y)[R][C]) {
  if (gemm.scales.symmetric() && gemm.unscale != 1.f)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) y[r][c] = _mm512_mul_ps(y[r][c], _mm512_set1_ps(gemm.unscale));
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(gemm.out + (m + r) * gemm.out_stride + (b + c) * 16),
                          cpuserve_simd::to_bf16_exact(y[r][c]));
}

}  // namespace cpuserve_vnni
#endif
