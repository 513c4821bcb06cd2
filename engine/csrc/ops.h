// The kernels other kernels call directly, without the dispatcher (decode_layers.cpp strings them together).
// Each is the same function torch.ops.cpuserve.<name> runs; its file owns it and documents it.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace cpuserve_ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);  // decode_ops.cpp
at::Tensor& silu_mul_out(const at::Tensor& gate_up, at::Tensor& out);          // decode_ops.cpp
void rope_write_kv(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t n_heads,
                   at::Tensor& pool, c10::optional<at::Tensor> pool_scale,
                   const at::Tensor& slot_mapping);  // decode_ops.cpp
at::Tensor& decode_attention_out(const at::Tensor& q, const at::Tensor& kv, const c10::optional<at::Tensor>& scale,
                                 const at::Tensor& block_tables, const at::Tensor& context_lens, double sm_scale,
                                 at::Tensor& out);  // decode_attention.cpp
at::Tensor& vnni_gemm_out(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                          const at::Tensor& zoffs, int64_t bits, int64_t act_group,
                          const c10::optional<at::Tensor>& supers, at::Tensor& out);  // vnni_gemm.cpp
// x [M, K] @ weight [N, K].T (+ bias) into out [M, N], fp32 or bf16: each element's bits independent of M
at::Tensor& dense_gemm_out(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                           at::Tensor& out);  // dense_gemm.cpp
// A stacked projection of a mixture of experts' experts: expert e's vnni_gemm operands at index e of each tensor
struct ExpertWeights {
  at::Tensor packed, scales, zoffs;
  c10::optional<at::Tensor> supers;
  int64_t bits, act_group;
};
// Rows [start, start + count) of x through expert `expert`'s weights of a stack
struct ExpertRows {
  int64_t expert, start, count;
};
// vnni_gemm_out for several experts of a stack at once, each on its rows of x [M, K] into the same rows of out [M, N]:
// the decode-sized ones in one parallel region, every row quantized once
at::Tensor& vnni_gemm_experts_out(const at::Tensor& x, const ExpertWeights& w, const std::vector<ExpertRows>& runs,
                                  at::Tensor& out);  // vnni_gemm.cpp
// x [N, dim] bf16 through the layer's router [E, dim] (fp32: dense_gemm; float64 where that is not built) and its
// k routed experts -> [N, dim] bf16
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& router, int64_t k, bool norm_topk_prob,
                       const ExpertWeights& gate_up, const ExpertWeights& down);  // moe_experts.cpp
// The checks of every GEMM over vnni_layouts.h's operands (vnni_gemm, amx_bf16_gemm): TORCH_CHECK on a mismatch
void check_gemm_operands(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                         const at::Tensor& zoffs, int64_t bits, int64_t act_group,
                         const c10::optional<at::Tensor>& supers, const at::Tensor& out);  // int8_gemm_checks.cpp

}  // namespace cpuserve_ops
