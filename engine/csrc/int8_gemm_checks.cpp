// The operands the int8 dot-product GEMMs take (vnni_gemm.cpp, amx_bf16_gemm.cpp: ops.h check_gemm_operands),
// checked at the op's boundary: shapes, types and the scales' forms (vnni_layouts.h has the layouts).

#include <ATen/ATen.h>

#include "ops.h"

#include <cstdint>

namespace {

// The scales' form: stored (fp32 or fp16 scales [N/16, S, 16], zoffs alike) or, with supers, a K-quant's factors
// (SuperScales); zoffs {z, e} for symmetric codes either way (e = 0 with supers)
void check_scales(const at::Tensor& scales, const at::Tensor& zoffs, const c10::optional<at::Tensor>& supers,
                  int64_t bits, int64_t N, int64_t K, int64_t act_group) {
  TORCH_CHECK(!supers.has_value() || bits == 4 || bits == 6, "factored scales (supers) go with 4- or 6-bit codes, got ",
              bits);
  const int64_t S = scales.size(1);
  TORCH_CHECK(S == 1 || (S % (K / act_group) == 0 && K % S == 0 && (K / S) % 16 == 0),
              "scales must have 1 (per channel) or K/act_group=", K / act_group,
              " groups or a multiple of it (weight groups of 16 or more inputs inside each activation group), got ", S);
  const bool symmetric = zoffs.scalar_type() == at::kInt;
  const int32_t* header = symmetric && zoffs.numel() == 2 && zoffs.is_contiguous() ? zoffs.data_ptr<int32_t>() : nullptr;
  TORCH_CHECK(!symmetric || (header && header[0] >= 0 && header[0] < (1 << bits) && header[1] >= 0 && header[1] < 64),
              "zoffs must be like scales, or two int32 {z, e}: a zero code z below 2**bits and 0 <= e < 64; got ",
              zoffs.scalar_type(), " ", zoffs.sizes());
  const bool shape = scales.is_contiguous() && scales.sizes() == at::IntArrayRef({N / 16, S, 16});
  const bool like_scales = zoffs.is_contiguous() && zoffs.sizes() == scales.sizes();
  if (!supers.has_value()) {
    TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) && shape,
                "scales must be contiguous fp32 or fp16 [N/16, S, 16], got ", scales.scalar_type(), " ", scales.sizes());
    TORCH_CHECK(symmetric || (zoffs.scalar_type() == scales.scalar_type() && like_scales),
                "zoffs must be like scales, or two int32 {z, e}; got ", zoffs.scalar_type(), " ", zoffs.sizes());
    return;
  }
  const at::Tensor& sp = *supers;
  TORCH_CHECK((scales.scalar_type() == at::kByte || scales.scalar_type() == at::kChar) && shape && S > 1,
              "with supers, scales must be contiguous uint8 or int8 sub-scales [N/16, K/act_group, 16], got ",
              scales.scalar_type(), " ", scales.sizes());
  const bool twelve_bits = scales.scalar_type() == at::kByte && zoffs.scalar_type() == at::kByte &&
                           zoffs.is_contiguous() && S % 2 == 0 && zoffs.sizes() == at::IntArrayRef({N / 16, S / 2, 16});
  TORCH_CHECK(symmetric ? header[1] == 0 : twelve_bits,
              "with supers, zoffs must be {z, 0} or the sub-mins' high nibbles, uint8 [N/16, S/2, 16] (two groups a "
              "byte, beside uint8 scales); got ", zoffs.scalar_type(), " ", zoffs.sizes());
  const int64_t P = sp.dim() == 4 && sp.size(1) > 0 && S % sp.size(1) == 0 ? S / sp.size(1) : 0;
  TORCH_CHECK(sp.scalar_type() == at::kHalf && sp.is_contiguous() && P > 0 && (P & (P - 1)) == 0 &&
                  sp.sizes() == at::IntArrayRef({N / 16, S / P, symmetric ? 1 : 2, 16}),
              "supers must be contiguous fp16 [N/16, S/P, F, 16], P a power of two, F = 1 (symmetric) or 2, got ",
              sp.scalar_type(), " ", sp.sizes());
}

}  // namespace

// x [M, K] bf16; packed [N/16, K*bits/32, 64] uint8; scales, zoffs, supers: check_scales; out [M, N] bf16, rows
// of any stride (a StackedLinear's part writes its columns). The operands of every GEMM over these layouts
// (vnni_gemm, amx_bf16_gemm.cpp).
void cpuserve_ops::check_gemm_operands(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                       const at::Tensor& zoffs, int64_t bits, int64_t act_group,
                                       const c10::optional<at::Tensor>& supers, const at::Tensor& out) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "bits must be 4, 6 or 8, got ", bits);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == 64 && packed.is_contiguous() &&
                  packed.size(1) * 32 % bits == 0,
              "packed must be contiguous uint8 [N/16, K*bits/32, 64], got ", packed.scalar_type(), " ", packed.sizes());
  const int64_t N = packed.size(0) * 16, K = packed.size(1) * 32 / bits;
  TORCH_CHECK(act_group % 16 == 0 && K % act_group == 0 && act_group <= 65536, "act_group=", act_group,
              " must be a multiple of 16 dividing K=", K, ", at most 65536 (a group's integer sum must fit int32)");
  check_scales(scales, zoffs, supers, bits, N, K, act_group);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous() && x.size(1) == K,
              "x must be contiguous bf16 [M, ", K, "], got ", x.scalar_type(), " ", x.sizes());
  const int64_t M = x.size(0);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.sizes() == at::IntArrayRef({M, N}) && out.stride(1) == 1 &&
                  out.stride(0) >= N,
              "out must be bf16 [", M, ", ", N, "] with contiguous rows (a block of columns of a wider output, too), "
              "got ", out.scalar_type(), " ", out.sizes(), " strides ", out.strides());
}
