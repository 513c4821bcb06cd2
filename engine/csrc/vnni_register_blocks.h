// The int8 dot-product GEMMs' register blocks on AVX-512 VNNI: R rows x C column blocks (16 columns each) of out,
// their integer sums in R x C vector registers, a group at a time, each group's epilogue (vnni_epilogue.h) into
// R x C fp32 sums, then one store. vpdpbusd does 64 multiply-adds (16 lanes x 4 byte pairs) where an FMA does 16,
// so once activations are int8 (act_quant.h) the same units do 4x the work, and weights never leave their packed
// bytes (vnni_layouts.h).
//
// Three forms of block, for the three ways activation groups meet weight groups (vnni_epilogue.h has their sums):
//   block         one weight group an activation group, or one scale per channel
//   block_nested  an activation group spans several weight groups (a K-quant's super-block)
//   block_token   per-channel symmetric weights, one activation group a row ("int8-token"): no per-group epilogue
#pragma once

#include "int8_gemm_operands.h"
#include "vnni_epilogue.h"
#include "vnni_layouts.h"

#include <cstdint>

#if defined(CPUSERVE_VNNI)
namespace cpuserve_vnni {

using cpuserve_int8::GemmOperands;

constexpr int64_t kPrefetch = 1024;  // bytes ahead in a column block's stream (tasks interleave between threads)
// Decode's distance: a task streams one run of column blocks from memory, and 1024 bytes ahead is ~40 ns at a core's
// read rate, well short of DRAM's latency. One thread, M = 1, 2048 x 2048 GEMMs streamed from memory (Zen 5, medians):
// 1024 -> 8192 bytes took Q4_K 28-31 -> 38-45 GB/s, Q6_K 27-31 -> 35-41, Q4_0 29-32 -> 36-42; at 8 rows Q4_K 13 -> 19.
constexpr int64_t kDecodePrefetch = 8192;

// What a register block's loops know at compile time, kAtRunTime where they read it from the operands: fixed, a
// group's Steps (of Codes<Bits>::kStep inputs) unroll and the epilogue loses its branches
enum class Known { kNo, kYes, kAtRunTime };

template <Known known>
constexpr bool known_or(bool at_run_time) {
  return known == Known::kAtRunTime ? at_run_time : known == Known::kYes;
}

// Steps > 0: a group (the activation group, or the weight group when nested) is Steps steps; Symmetric: the
// scales' symmetric(); PerChannel: one scale per output channel; Nested: block_nested, else block
template <int Steps = 0, Known Symmetric = Known::kAtRunTime, Known PerChannel = Known::kAtRunTime, bool Nested = false>
struct Form {
  static constexpr int kSteps = Steps;
  static constexpr Known kSymmetric = Symmetric, kPerChannel = PerChannel;
  static constexpr bool kNested = Nested;
};
using RunTimeForm = Form<>;
using RunTimeNestedForm = Form<0, Known::kAtRunTime, Known::kNo, true>;

// acc[r][c] += the products of rows row_codes + r * K and column blocks b + c over inputs k..k+kStep-1, prefetching
// the codes `ahead` bytes past these (inlined: called, the unrolled group of 4-bit codes ran 155 -> 110)
template <int Bits, int R, int C, typename Scales>
CPUSERVE_HOT void step_dots(const GemmOperands<Scales>& gemm, __m512i (&acc)[R][C], const int8_t* row_codes,
                            int64_t k, int64_t b, int64_t ahead) {
  using W = Codes<Bits>;
  const int64_t K = gemm.K;
  __m512i codes[C][W::kOps];
  for (int c = 0; c < C; ++c) {
    // 64 bytes per 4 inputs' worth of operands
    const uint8_t* p = gemm.packed + (b + c - gemm.first_block) * K * 2 * Bits + k * 2 * Bits;
    if (ahead > 0)  // every line of the step's codes: 6-bit steps span 3, 8-bit 2 (one left the rest to the hardware)
      for (int o = 0; o < W::kStep * 2 * Bits; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p + ahead + o), _MM_HINT_T0);
    W::load(p, codes[c]);
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < W::kOps; ++i) {
      if constexpr (C == 1) {
        acc[r][0] = dpbusd_bcast(acc[r][0], codes[0][i], row_codes + r * K + k + 4 * i);
      } else {  // one broadcast for the C blocks: Zen 4 runs the memory-broadcast form slower (a loop of
                // vpdpbusd alone, 6 x 2: 404-459 G multiply-adds a second against 534-540)
        const __m512i act = broadcast4(row_codes + r * K + k + 4 * i);
        for (int c = 0; c < C; ++c) acc[r][c] = dpbusd(acc[r][c], codes[c][i], act);
      }
    }
}

// acc[r][c] = the integer sums of rows m + r and column blocks b + c over group g (`group` inputs), started at the
// symmetric form's zero term (code_sums: num_groups groups a row). Steps > 0: the group's steps unrolled.
template <int Bits, int R, int C, int Steps, typename Scales>
CPUSERVE_HOT void group_sums(const GemmOperands<Scales>& gemm, __m512i (&acc)[R][C], int64_t m, int64_t g,
                             int64_t group, int64_t num_groups, bool symmetric, int64_t b, int64_t ahead) {
  using W = Codes<Bits>;
  const int8_t* row_codes = gemm.act_codes + m * gemm.K;
  for (int r = 0; r < R; ++r) {
    const __m512i start = symmetric ? _mm512_set1_epi32(-gemm.zero_code * gemm.code_sums[(m + r) * num_groups + g])
                                    : _mm512_setzero_si512();
    for (int c = 0; c < C; ++c) acc[r][c] = start;
  }
  // step_dots called directly, not through a lambda: GCC 12 left such a lambda out of line, with the accumulators
  // stored and reloaded around every step (SmolLM2's 4-bit GEMMs at 512 rows, one thread: 101 G multiply-adds a
  // second that way)
  if constexpr (Steps > 0) {
#pragma GCC unroll 16
    for (int s = 0; s < Steps; ++s) step_dots<Bits, R, C>(gemm, acc, row_codes, g * group + s * W::kStep, b, ahead);
  } else {
    for (int64_t k = g * group; k < (g + 1) * group; k += W::kStep)
      step_dots<Bits, R, C>(gemm, acc, row_codes, k, b, ahead);
  }
}

// Rows m..m+R-1 of column blocks b..b+C-1, prefetching the codes `ahead` bytes past each step's: one weight group
// an activation group, or one scale per channel (F: Form)
template <int Bits, int R, int C, typename F, typename Scales>
inline void block(const GemmOperands<Scales>& gemm, int64_t m, int64_t b, int64_t ahead) {
  const int64_t act_groups = gemm.num_act_groups();
  const bool per_channel = known_or<F::kPerChannel>(gemm.num_weight_groups == 1);
  const bool symmetric = known_or<F::kSymmetric>(gemm.scales.symmetric());
  const int64_t group = F::kSteps > 0 ? F::kSteps * Codes<Bits>::kStep : gemm.act_group;
  __m512 y[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < act_groups; ++g) {
    __m512i acc[R][C];
    group_sums<Bits, R, C, F::kSteps>(gemm, acc, m, g, group, act_groups, symmetric, b, ahead);
    group_terms<R, C>(gemm, y, acc, m, g, b, per_channel, symmetric);
  }
  if (per_channel) channel_terms<R, C>(gemm, y, m, b, symmetric);
  store<R, C>(gemm, m, b, y);
}

// block where an activation group spans per_act_group > 1 weight groups (a K-quant's super-block of 256 inputs
// against its groups of 32 or 16, as llama.cpp's own Q8_K activations): each weight group's integer sum is
// converted and scaled by the weights' scale into act_group_sum, the zero term added there, and the activation
// scale multiplies act_group_sum once per activation group. Per weight group that is 1 multiply (symmetric) or 2,
// against 2 or 3 with the activation scale per weight group; the sums are as exact and run in the same order for
// every output element. F::kSteps > 0: a weight group is kSteps steps.
//
// Where the activation group is the super-block of a K-quant with sub-mins (Q2_K, Q4_K, Q5_K), the zero term is
// not a multiply per group but zero_term's integer sums, one vpdpwssd per two groups.
template <int Bits, int R, int C, typename F, typename Scales>
inline void block_nested(const GemmOperands<Scales>& gemm, int64_t m, int64_t b, int64_t ahead) {
  const int64_t act_groups = gemm.num_act_groups(), per_act_group = gemm.num_weight_groups / act_groups;
  const int64_t group = F::kSteps > 0 ? F::kSteps * Codes<Bits>::kStep : gemm.K / gemm.num_weight_groups;
  const bool symmetric = known_or<F::kSymmetric>(gemm.scales.symmetric());
  const bool int_zero_term = !symmetric && gemm.has_int_zero_term();
  __m512 y[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r][c] = _mm512_setzero_ps();
  for (int64_t a = 0; a < act_groups; ++a) {
    __m512 act_group_sum[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) act_group_sum[r][c] = _mm512_setzero_ps();
    for (int64_t g = a * per_act_group; g < (a + 1) * per_act_group; ++g) {
      __m512i acc[R][C];
      group_sums<Bits, R, C, F::kSteps>(gemm, acc, m, g, group, gemm.num_weight_groups, symmetric, b, ahead);
      weight_group_terms<R, C>(gemm, act_group_sum, acc, m, g, b, symmetric || int_zero_term);
    }
    activation_group_terms<R, C>(gemm, y, act_group_sum, m, a, b, int_zero_term);
    // Where y's R x C registers would crowd out the weight groups' (6-bit codes in 8 x 1 blocks: acc, act_group_sum
    // and y take 24 of the 32 vector registers, a step's codes 4 more), y waits in memory until the next activation
    // group: a store and a load there, where GCC spilled sums every weight group (Q6_K at 8 rows: 13 stack accesses
    // a weight group, none this way)
    if constexpr (3 * R * C + Codes<Bits>::kOps >= 28) asm("" : "+m"(y));
  }
  store<R, C>(gemm, m, b, y);
}

// block for per-channel symmetric codes with one activation group a row (act_group = K: "int8-token"): the integer
// sums run over all of K with no fp32 accumulator live beside them, then one epilogue, the same instructions per
// output element as block's per-channel path (whose FMA adds the product to 0). One thread, SmolLM2's four layer
// GEMMs at 512 rows, alternating builds: 177-202 G multiply-adds a second through block, 200-208 here.
template <int Bits, int R, int C, typename Scales>
inline void block_token(const GemmOperands<Scales>& gemm, int64_t m, int64_t b, int64_t ahead) {
  const int8_t* row_codes = gemm.act_codes + m * gemm.K;
  __m512i acc[R][C];
  for (int r = 0; r < R; ++r) {
    const __m512i start = _mm512_set1_epi32(-gemm.zero_code * gemm.code_sums[m + r]);
    for (int c = 0; c < C; ++c) acc[r][c] = start;
  }
  for (int64_t k = 0; k < gemm.K; k += Codes<Bits>::kStep) step_dots<Bits, R, C>(gemm, acc, row_codes, k, b, ahead);
  for (int c = 0; c < C; ++c) {
    const __m512 scale = gemm.scales.scale(b + c, 0);
    for (int r = 0; r < R; ++r) {
      __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), _mm512_set1_ps(gemm.act_scales[m + r]),
                                 _mm512_setzero_ps());
      y = _mm512_mul_ps(y, scale);
      if (gemm.unscale != 1.f) y = _mm512_mul_ps(y, _mm512_set1_ps(gemm.unscale));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(gemm.out + (m + r) * gemm.out_stride + (b + c) * 16),
                          cpuserve_simd::to_bf16_exact(y));
    }
  }
}


// The block of Form F for rows m..m+R-1
template <int Bits, int R, int C, typename F, typename Scales>
inline void row_block(const GemmOperands<Scales>& gemm, int64_t m, int64_t b, int64_t ahead) {
  if constexpr (F::kNested) {
    block_nested<Bits, R, C, F>(gemm, m, b, ahead);
  } else {
    block<Bits, R, C, F>(gemm, m, b, ahead);
  }
}

// The last rows m..m+left-1 (left <= R) as one block of `left` rows
template <int Bits, int R, int C, typename F, typename Scales>
inline void tail_rows(const GemmOperands<Scales>& gemm, int64_t m, int64_t left, int64_t b, int64_t ahead) {
  if constexpr (R > 0) {
    if (left == R) return row_block<Bits, R, C, F>(gemm, m, b, ahead);
    tail_rows<Bits, R - 1, C, F>(gemm, m, left, b, ahead);
  }
}

// Every row through column blocks b..b+C-1: R rows per register block, then one block of the last M % R. The
// first register block prefetches `ahead` bytes past its codes (the rest find them in the caches).
template <int Bits, int R, int C, typename F, typename Scales>
inline void all_rows(const GemmOperands<Scales>& gemm, int64_t M, int64_t b, int64_t ahead = kPrefetch) {
  int64_t m = 0;
  const int64_t later = ahead > 0 ? kPrefetch : 0;  // none: the codes are a tile's unpacked copy
  for (; m + R <= M; m += R) row_block<Bits, R, C, F>(gemm, m, b, m == 0 ? ahead : later);
  tail_rows<Bits, R - 1, C, F>(gemm, m, M - m, b, m == 0 ? ahead : later);
}

// all_rows of the "int8-token" form (block_token); the last M % R rows through block's per-channel path: the same bits
template <int Bits, int R, int C, typename Scales>
inline void all_rows_token(const GemmOperands<Scales>& gemm, int64_t M, int64_t b, int64_t ahead) {
  int64_t m = 0;
  const int64_t later = ahead > 0 ? kPrefetch : 0;
  for (; m + R <= M; m += R) block_token<Bits, R, C>(gemm, m, b, m == 0 ? ahead : later);
  tail_rows<Bits, R - 1, C, RunTimeForm>(gemm, m, M - m, b, m == 0 ? ahead : later);
}

// all_rows with the steps, the form and the nesting read at run time
template <int Bits, int R, int C, typename Scales>
inline void all_rows_at_run_time(const GemmOperands<Scales>& gemm, int64_t M, int64_t b, int64_t ahead) {
  if (gemm.is_nested()) return all_rows<Bits, R, C, RunTimeNestedForm>(gemm, M, b, ahead);
  all_rows<Bits, R, C, RunTimeForm>(gemm, M, b, ahead);
}

// all_rows with the group's steps and the symmetric form fixed at compile time where they are the usual ones
// (groups of 32 or 16): the group's steps unrolled and its epilogue free of branches. The same instructions for each
// output element in the same order, so a row's result is the runtime path's. One thread, SmolLM2's layer GEMMs:
// 294-319 against 230-243 G multiply-adds a second at 512 rows, 173-272 against 159-221 at 8 rows.
template <int Bits, int R, int C, typename Scales>
inline void all_rows_fixed(const GemmOperands<Scales>& gemm, int64_t M, int64_t b, int64_t ahead) {
  constexpr int kSteps16 = 16 / Codes<Bits>::kStep, kSteps32 = 32 / Codes<Bits>::kStep;
  constexpr Known kYes = Known::kYes, kNo = Known::kNo;
  const int64_t weight_groups = gemm.num_weight_groups;
  if (gemm.is_nested()) {  // a K-quant's weight groups of 32 or 16 inside activation groups of a super-block
    const int64_t group = gemm.K / weight_groups;
    if (group == 32) {
      if (gemm.scales.symmetric()) return all_rows<Bits, R, C, Form<kSteps32, kYes, kNo, true>>(gemm, M, b, ahead);
      return all_rows<Bits, R, C, Form<kSteps32, kNo, kNo, true>>(gemm, M, b, ahead);
    }
    if (group == 16) {
      if (gemm.scales.symmetric()) return all_rows<Bits, R, C, Form<kSteps16, kYes, kNo, true>>(gemm, M, b, ahead);
      return all_rows<Bits, R, C, Form<kSteps16, kNo, kNo, true>>(gemm, M, b, ahead);
    }
    return all_rows_at_run_time<Bits, R, C>(gemm, M, b, ahead);
  }
  // one activation group a row, beyond decode (whose 8 x 1 blocks ran slower through block_token: one thread,
  // 8 rows, 130 against 143-146 G multiply-adds a second)
  if (C > 1 && weight_groups == 1 && gemm.act_group == gemm.K && gemm.scales.symmetric())
    return all_rows_token<Bits, R, C>(gemm, M, b, ahead);
  // Per channel (the engine's own int8 weights, from a float checkpoint) the same way: on the runtime path, one
  // thread, 512 rows made 119-126 G multiply-adds a second, 32 rows 146-160; fixed, 173-182 and 156-176
  if (weight_groups == 1 && gemm.act_group == 32) {
    if (gemm.scales.symmetric()) return all_rows<Bits, R, C, Form<kSteps32, kYes, kYes>>(gemm, M, b, ahead);
    return all_rows<Bits, R, C, Form<kSteps32, kNo, kYes>>(gemm, M, b, ahead);
  }
  if (weight_groups > 1 && gemm.act_group == 32) {
    if (gemm.scales.symmetric()) return all_rows<Bits, R, C, Form<kSteps32, kYes, kNo>>(gemm, M, b, ahead);
    return all_rows<Bits, R, C, Form<kSteps32, kNo, kNo>>(gemm, M, b, ahead);
  }
  if (weight_groups > 1 && gemm.act_group == 16) {  // Q6_K, Q3_K (symmetric), Q2_K
    if (gemm.scales.symmetric()) return all_rows<Bits, R, C, Form<kSteps16, kYes, kNo>>(gemm, M, b, ahead);
    return all_rows<Bits, R, C, Form<kSteps16, kNo, kNo>>(gemm, M, b, ahead);
  }
  all_rows_at_run_time<Bits, R, C>(gemm, M, b, ahead);
}

}  // namespace cpuserve_vnni
#endif
