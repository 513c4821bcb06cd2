// The int8 dot-product GEMMs' register blocks on CPUs with AVX2 and no AVX-512 VNNI: AMD Zen 2 and 3, Intel Haswell
// to Skylake, and with AVX-VNNI Alder Lake and Sierra Forest. vnni_gemm.cpp's vnni_gemm_out (the checks, the
// activations' quantization, the weight forms) runs them in the AVX2 levels' build, as it runs its own in AVX-512's.
//
// The same scheme on the same packed operands (vnni_layouts.h) and activations (act_quant.h): each group's integer
// sums are exact (avx2_layouts.h: vpmaddubsw within its int16 bounds, or AVX-VNNI's vpdpbusd on 8 lanes), and
// every output element's fp32 epilogue is vnni_epilogue.h's own, the same operations in the same
// order (block, block_nested; their AMX path gives the same bits). So this build's output is the AVX-512 build's,
// bit for bit (tests/engine/test_kernel_levels.py compares them), whatever the rows, the tiling or the threads.
//
// A register block is R rows x one column block of 16 columns (two halves of 8 lanes): 4 rows keep 8 integer
// accumulators, a step's operands and a broadcast within AVX2's 16 vector registers. A task is a run of adjacent
// column blocks, every row through each (decode: the block's codes streamed from memory once for all rows; prompt
// rows: read from L1 for every register block of rows).
#pragma once

#include <ATen/ATen.h>

#include "avx2_layouts.h"
#include "int8_gemm_operands.h"
#include "tasks.h"

#if defined(CPUSERVE_AVX2_GEMM)
#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace cpuserve_avx2 {

using bf16 = at::BFloat16;
// Bytes ahead in a column block's stream, in the first register block of rows: far enough to cover DRAM's latency at
// decode (one thread, M = 1, 2048 x 2048 GEMMs streamed, Zen 5 forced to this level: 1024 -> 8192 bytes took Q4_K
// 22-23 -> 28-29 GB/s, Q6_K 21-23 -> 27-33, Q4_0 22 -> 30-32; 8 and 128 rows, compute-bound, unchanged)
constexpr int64_t kPrefetch = 8192;
constexpr int64_t kTasksPerThread = 4;  // runs of column blocks per thread (vnni_gemm.cpp's decode tasks)
constexpr int kRows = 4;

// The operands (int8_gemm_operands.h) and the register blocks over them
template <int Bits, typename Scales>
struct Gemm : cpuserve_int8::GemmOperands<Scales> {
  using W = Codes<Bits>;
  using Operands = cpuserve_int8::GemmOperands<Scales>;
  using Operands::act_codes, Operands::act_scales, Operands::act_sums, Operands::code_sums, Operands::code_sums16;
  using Operands::act_row_sum, Operands::packed, Operands::scales, Operands::zero_code, Operands::unscale;
  using Operands::K, Operands::act_group, Operands::num_weight_groups, Operands::N, Operands::out, Operands::out_stride;
  using Operands::num_act_groups, Operands::is_nested, Operands::has_int_zero_term;

  // acc[r][h] = the integer sums of rows m + r, column block b, over group g (of num_groups a row: inputs [k0, k1)),
  // with the symmetric form's zero term -z * sum q and, for 8-bit codes taken as signed bytes (avx2_layouts.h), the
  // 128 * sum q they leave out. The 4-bit form without AVX-VNNI adds that term after its chunks, so that no
  // accumulator waits beside theirs.
  template <int R, int Steps>
  CPUSERVE_HOT void group_sums(__m256i (&acc)[R][2], int64_t m, int64_t g, int64_t num_groups, bool symmetric,
                               int64_t k0, int64_t k1, int64_t b, int64_t ahead) const {
    const int32_t shift = Bits == 8 && !kVnni ? 128 : 0, zero = symmetric ? zero_code : 0;
    const auto term = [&](int r) { return _mm256_set1_epi32((shift - zero) * code_sums[(m + r) * num_groups + g]); };
    if constexpr (Bits == 4 && !kVnni) {
      sums<R, Steps>(acc, m, k0, k1, b, ahead);
      if (zero != 0)
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_add_epi32(acc[r][h], term(r));
    } else {
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = term(r);
      sums<R, Steps>(acc, m, k0, k1, b, ahead);
    }
  }

  // acc[r][h] += the products of one step (W::kStep inputs from k) of rows qm + r * K, codes at p; the 4-bit form
  // without AVX-VNNI adds int16 pair sums (the caller widens them within their bound)
  template <int R>
  CPUSERVE_HOT void step(__m256i (&acc)[R][2], const int8_t* qm, int64_t k, const uint8_t* p, int64_t ahead) const {
    if (ahead > 0)
      for (int o = 0; o < W::kBytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + ahead + o), _MM_HINT_T0);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; ++h) {
      __m256i wv[W::kOps];
      W::load(p, h, wv);
      for (int r = 0; r < R; ++r) {
        const int8_t* a = qm + r * K + k;
        if constexpr (kVnni) {
          for (int i = 0; i < W::kOps; ++i)
            acc[r][h] = _mm256_dpbusd_avx_epi32(acc[r][h], wv[i], broadcast4(a + 4 * i));
        } else if constexpr (Bits == 4) {
          acc[r][h] = _mm256_add_epi16(acc[r][h], _mm256_maddubs_epi16(wv[0], broadcast4(a)));
          acc[r][h] = _mm256_add_epi16(acc[r][h], _mm256_maddubs_epi16(wv[1], broadcast4(a + 4)));
        } else if constexpr (Bits == 6) {
          for (int i = 0; i < 4; i += 2) {
            const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(wv[i], broadcast4(a + 4 * i)),
                                                  _mm256_maddubs_epi16(wv[i + 1], broadcast4(a + 4 * i + 4)));
            acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(pair, ones));
          }
        } else {  // |w| times q with w's sign
          const __m256i prod = _mm256_maddubs_epi16(_mm256_abs_epi8(wv[0]), _mm256_sign_epi8(broadcast4(a), wv[0]));
          acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(prod, ones));
        }
      }
    }
  }

  // acc[r][h] += the integer sums of rows m + r, column block b, inputs [k0, k1) (the 4-bit form without AVX-VNNI:
  // acc = them); Steps > 0: k1 - k0 is Steps * W::kStep (unrolled)
  template <int R, int Steps>
  CPUSERVE_HOT void sums(__m256i (&acc)[R][2], int64_t m, int64_t k0, int64_t k1, int64_t b, int64_t ahead) const {
    const int8_t* qm = act_codes + m * K;
    const uint8_t* base = packed + b * K * 2 * Bits;
    constexpr bool kChunks = Bits == 4 && !kVnni;
    if constexpr (!kChunks) {
      if constexpr (Steps > 0) {
#pragma GCC unroll 16
        for (int s = 0; s < Steps; ++s) {
          const int64_t k = k0 + s * W::kStep;
          step<R>(acc, qm, k, base + k * 2 * Bits, ahead);
        }
      } else {
        for (int64_t k = k0; k < k1; k += W::kStep) step<R>(acc, qm, k, base + k * 2 * Bits, ahead);
      }
    } else {  // int16 pair sums over chunks of up to 32 inputs (4 steps), then widened
      const __m256i ones = _mm256_set1_epi16(1);
      for (int64_t k = k0; k < k1; k += 32) {
        __m256i part[R][2];
        for (int r = 0; r < R; ++r) part[r][0] = part[r][1] = _mm256_setzero_si256();
        if constexpr (Steps > 0 && Steps <= 4) {
#pragma GCC unroll 4
          for (int s = 0; s < Steps; ++s) step<R>(part, qm, k + s * 8, base + (k + s * 8) * 8, ahead);
        } else {
          for (int64_t kk = k; kk < std::min(k + 32, k1); kk += 8) step<R>(part, qm, kk, base + kk * 8, ahead);
        }
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < 2; ++h) {
            const __m256i wide = _mm256_madd_epi16(part[r][h], ones);
            acc[r][h] = k == k0 ? wide : _mm256_add_epi32(acc[r][h], wide);
          }
      }
    }
  }

  // Rows m..m+R-1 of column block b where each activation group is one weight group or holds every weight group
  // (per channel): vnni_register_blocks.h's block
  template <int R, int Steps>
  void block(int64_t m, int64_t b, int64_t ahead) const {
    const int64_t act_groups = K / act_group;
    const bool per_channel = num_weight_groups == 1, symmetric = scales.symmetric();
    __m256 y[R][2];
    for (int r = 0; r < R; ++r) y[r][0] = y[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < act_groups; ++g) {
      __m256i acc[R][2];
      group_sums<R, Steps>(acc, m, g, act_groups, symmetric, g * act_group, (g + 1) * act_group, b, ahead);
      group_terms<R>(y, acc, m, g, b, per_channel, symmetric);
    }
    if (per_channel) channel_terms<R>(y, m, b, symmetric);
    store<R>(m, b, y);
  }

  template <int R>
  CPUSERVE_HOT void group_terms(__m256 (&y)[R][2], const __m256i (&acc)[R][2], int64_t m, int64_t g, int64_t b,
                                bool per_channel, bool symmetric) const {
    const int64_t act_groups = K / act_group;
    if (per_channel) {
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_set1_ps(act_scales[(m + r) * act_groups + g]);
        for (int h = 0; h < 2; ++h) y[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), a, y[r][h]);
      }
      return;
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 sv = scales.scale(b, g, h);
      const __m256 zv = symmetric ? _mm256_setzero_ps() : scales.zoff(b, g, h);
      for (int r = 0; r < R; ++r) {
        const __m256 t = _mm256_mul_ps(sv, _mm256_set1_ps(act_scales[(m + r) * act_groups + g]));
        y[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), t, y[r][h]);
        if (!symmetric) y[r][h] = _mm256_fmadd_ps(zv, _mm256_set1_ps(act_sums[(m + r) * act_groups + g]), y[r][h]);
      }
    }
  }

  template <int R>
  CPUSERVE_HOT void channel_terms(__m256 (&y)[R][2], int64_t m, int64_t b, bool symmetric) const {
    for (int h = 0; h < 2; ++h) {
      const __m256 sv = scales.scale(b, 0, h);
      if (symmetric) {
        for (int r = 0; r < R; ++r) y[r][h] = _mm256_mul_ps(y[r][h], sv);
        continue;
      }
      const __m256 zv = scales.zoff(b, 0, h);
      for (int r = 0; r < R; ++r)
        y[r][h] = _mm256_fmadd_ps(y[r][h], sv, _mm256_mul_ps(zv, _mm256_set1_ps(act_row_sum[m + r])));
    }
  }

  // Rows m..m+R-1 of column block b where an activation group spans per_act_group weight groups (a K-quant's
  // super-block): vnni_register_blocks.h's block_nested, with vnni_epilogue.h's weight_group_terms,
  // activation_group_terms and zero_term
  template <int R, int Steps>
  void block_nested(int64_t m, int64_t b, int64_t ahead) const {
    const int64_t act_groups = K / act_group, per_act_group = num_weight_groups / act_groups;
    const int64_t group = K / num_weight_groups;
    const bool symmetric = scales.symmetric(), int_mins = !symmetric && has_int_zero_term();
    __m256 y[R][2];
    for (int r = 0; r < R; ++r) y[r][0] = y[r][1] = _mm256_setzero_ps();
    for (int64_t a = 0; a < act_groups; ++a) {
      __m256 t[R][2];
      for (int r = 0; r < R; ++r) t[r][0] = t[r][1] = _mm256_setzero_ps();
      for (int64_t g = a * per_act_group; g < (a + 1) * per_act_group; ++g) {
        __m256i acc[R][2];
        group_sums<R, Steps>(acc, m, g, num_weight_groups, symmetric, g * group, (g + 1) * group, b, ahead);
        for (int h = 0; h < 2; ++h) {
          const __m256 sv = scales.scale(b, g, h);
          for (int r = 0; r < R; ++r) t[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), sv, t[r][h]);
          if (symmetric || int_mins) continue;
          const __m256 zv = scales.zoff(b, g, h);
          for (int r = 0; r < R; ++r)
            t[r][h] = _mm256_fmadd_ps(zv, _mm256_set1_ps(act_sums[(m + r) * num_weight_groups + g]), t[r][h]);
        }
      }
      if (int_mins) zero_term<R>(t, m, a * per_act_group, per_act_group, b);
      for (int r = 0; r < R; ++r) {
        const __m256 av = _mm256_set1_ps(act_scales[(m + r) * act_groups + a]);
        for (int h = 0; h < 2; ++h) y[r][h] = _mm256_fmadd_ps(t[r][h], av, y[r][h]);
      }
    }
    store<R>(m, b, y);
  }

  // t += -dmin * the sum over groups g0..g0+per_act_group-1 of sub_min * (the row's code sum of the group): exact
  // int32 sums
  template <int R>
  CPUSERVE_HOT void zero_term(__m256 (&t)[R][2], int64_t m, int64_t g0, int64_t per_act_group, int64_t b) const {
    for (int h = 0; h < 2; ++h) {
      __m256i zi[R];
      for (int r = 0; r < R; ++r) zi[r] = _mm256_setzero_si256();
      for (int64_t g = g0; g < g0 + per_act_group; g += 2) {
        const __m256i mins = scales.min_pair(b, g, h);
        for (int r = 0; r < R; ++r) {
          const auto* sums16 = code_sums16 + (m + r) * num_weight_groups + g;  // g's, g + 1's
          const __m256i pair = broadcast4(reinterpret_cast<const int8_t*>(sums16));
          zi[r] = _mm256_add_epi32(zi[r], _mm256_madd_epi16(mins, pair));
        }
      }
      const __m256 dm = scales.neg_dmin(b, g0, h);
      for (int r = 0; r < R; ++r) t[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(zi[r]), dm, t[r][h]);
    }
  }

  template <int R>
  CPUSERVE_HOT void store(int64_t m, int64_t b, __m256 (&y)[R][2]) const {
    const bool unscaled = scales.symmetric() && unscale != 1.f;
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) {
        const __m256 v = unscaled ? _mm256_mul_ps(y[r][h], _mm256_set1_ps(unscale)) : y[r][h];
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (m + r) * out_stride + b * 16 + 8 * h), to_bf16(v));
      }
  }

  // Every row of column block b: kRows at a time, then 2 and 1; the first register block prefetches
  template <int Steps, int Nest>
  void all_rows(int64_t M, int64_t b) const {
    int64_t m = 0, ahead = kPrefetch;
    const auto one = [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      if constexpr (Nest) {
        block_nested<R, Steps>(m, b, ahead);
      } else {
        block<R, Steps>(m, b, ahead);
      }
      m += R, ahead = 0;
    };
    while (m + kRows <= M) one(std::integral_constant<int, kRows>{});
    if (m + 2 <= M) one(std::integral_constant<int, 2>{});
    if (m < M) one(std::integral_constant<int, 1>{});
  }

  // all_rows with a group's steps fixed at compile time where the group is 16 or 32 inputs
  void all_rows_fixed(int64_t M, int64_t b) const {
    const bool per_channel = num_weight_groups == 1;
    const int64_t group = is_nested() ? K / num_weight_groups : (per_channel && act_group != 32 ? 0 : act_group);
    const auto fixed = [&](auto nest) {
      constexpr int Nest = decltype(nest)::value;
      if (group == 32 && 32 % W::kStep == 0) return all_rows<32 / W::kStep, Nest>(M, b);
      if (group == 16 && 16 % W::kStep == 0) return all_rows<16 / W::kStep, Nest>(M, b);
      all_rows<0, Nest>(M, b);
    };
    if (is_nested()) return fixed(std::integral_constant<int, 1>{});
    fixed(std::integral_constant<int, 0>{});
  }

  // Every row through column blocks [b, end), on the calling thread
  void decode_blocks(int64_t M, int64_t b, int64_t end) const {
    for (; b < end; ++b) all_rows_fixed(M, b);
  }

  void run(int64_t M) const {
    const int64_t blocks = N / 16, run = cpuserve_tasks::run_length(blocks, kTasksPerThread);
    cpuserve_tasks::share_tasks((blocks + run - 1) / run, [&](const auto& next) {
      for (int64_t t; (t = next()) >= 0;) decode_blocks(M, t * run, std::min(blocks, (t + 1) * run));
    });
  }
};

}  // namespace cpuserve_avx2
#endif
