// The operands of one int8 dot-product GEMM (vnni_gemm.cpp) as its kernels read them, in the AVX-512 build
// (vnni_register_blocks.h, vnni_amx_rows.h) and the AVX2 one (avx2_gemm.h) alike.
//
//   x [M, K] bf16, quantized per row (act_quant.h) into, per row m:
//     act_codes     [K] int8                   x ~= act_scales[a] * act_codes over activation group a
//     act_scales    [num_act_groups]           one per act_group inputs (num_act_groups = K / act_group)
//     code_sums     [num_sum_groups] int32     the sum of the codes over a sum group (code_sums16: as int16)
//     act_sums      [num_sum_groups]           act_scales * code_sums: what a zoff multiplies (nested: the code
//                                              sum alone, the activation scale applied after the weight groups)
//     act_row_sum   [1]                        the sum of the row's act_sums (the per-channel form's zero term)
//   packed codes [N/16, ...] and their scales (vnni_layouts.h): num_weight_groups scales per column along K
//     (1: per channel), each group K / num_weight_groups inputs.
//   out [M, N] bf16, rows out_stride apart.
//
// The sum groups are the activation groups, or the weight groups where an activation group spans several of them
// (nested: a K-quant's super-block of 256 inputs against its groups of 32 or 16).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

namespace cpuserve_int8 {

// The largest weight group whose code sums (at most 127 each) fit int16: the nested form's integer zero term
constexpr int64_t kInt16Group = 256;

template <typename Scales>
struct GemmOperands {
  const int8_t* act_codes;     // [M, K]
  const float* act_scales;     // [M, num_act_groups()]
  const float* act_sums;       // [M, num_sum_groups()]
  const int32_t* code_sums;    // [M, num_sum_groups()]: the symmetric form's zero term
  const int16_t* code_sums16;  // [M, num_sum_groups()]: the nested form's integer zero term (zero_term)
  const float* act_row_sum;    // [M]
  const uint8_t* packed;       // the packed codes
  int64_t first_block;         // the first column block `packed` holds (0, or a column tile's unpacked copy)
  Scales scales;               // StoredScales or SuperScales (vnni_layouts.h; avx2_layouts.h)
  int32_t zero_code;           // the symmetric form's zero code z
  float unscale;               // the symmetric form's 2^-e
  int64_t K, act_group, num_weight_groups, N;
  at::BFloat16* out;
  int64_t out_stride;  // out's row stride (N, or more when out is a block of columns of a wider output)

  int64_t num_act_groups() const { return K / act_group; }
  int64_t num_sum_groups() const { return std::max(num_act_groups(), num_weight_groups); }
  // an activation group spans several weight groups
  bool is_nested() const { return num_weight_groups > num_act_groups(); }
  int64_t weight_groups_per_act_group() const { return num_weight_groups / num_act_groups(); }
  // the inputs of a weight group (of an activation group where the weights have one scale per channel)
  int64_t weight_group_size() const { return is_nested() ? K / num_weight_groups : act_group; }

  // Whether the nested form takes the zero term as zero_term's integer sums: nested groups with sub-mins (Q2_K,
  // Q4_K, Q5_K), an activation group that is the super-block, code sums that fit int16
  bool has_int_zero_term() const {
    return is_nested() && scales.int_mins(weight_groups_per_act_group()) && K / num_weight_groups <= kInt16Group;
  }

  // These operands' rows from m0 on, as a GEMM of M - m0 rows (the row arrays moved on)
  GemmOperands rows_from(int64_t m0) const {
    GemmOperands rows = *this;
    const int64_t act_groups = num_act_groups(), sum_groups = num_sum_groups();
    rows.act_codes += m0 * K, rows.act_scales += m0 * act_groups, rows.act_sums += m0 * sum_groups;
    rows.code_sums += m0 * sum_groups, rows.code_sums16 += m0 * sum_groups, rows.act_row_sum += m0;
    rows.out += m0 * out_stride;
    return rows;
  }
};

// fn(Super<Sub, Symmetric>{}): the type of a K-quant's factored scales (SuperScales, vnni_layouts.h or
// avx2_layouts.h) for uint8 sub-scales (unsigned_subs) or int8 ones, with sub-mins or symmetric. Chosen here once,
// so the register blocks see symmetric() as a constant. int8 sub-scales (negative: Q3_K, Q6_K) come without sub-mins
// (int8_gemm_checks.cpp).
template <template <typename, bool> class Super, typename Fn>
void with_super_scales(bool unsigned_subs, bool symmetric, Fn&& fn) {
  TORCH_INTERNAL_ASSERT(unsigned_subs || symmetric, "int8 sub-scales with sub-mins");
  if (!unsigned_subs) return fn(Super<int8_t, true>{});
  if (symmetric) return fn(Super<uint8_t, true>{});
  fn(Super<uint8_t, false>{});
}

}  // namespace cpuserve_int8
