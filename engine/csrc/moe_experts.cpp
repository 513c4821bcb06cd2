// A mixture-of-experts layer's routed experts in one call: torch.ops.cpuserve.moe_experts.
//
// engine/models/moe.py's reference runs each active expert from Python: a gather, two GEMMs and silu(gate) * up
// per expert, then a weighted add per expert; at one decode row (Qwen3-30B-A3B: 8 experts a layer) that is ~40
// dispatches a layer for GEMMs of some tens of microseconds. This runs the very same kernels (ops.h) in the same
// order, so its result is the reference's bit for bit (tests/engine/test_moe.py):
//
//     route    moe.py's MoE.route in the same torch ops: logits = x in float64 times the router, rounded to fp32;
//              softmax over all experts, the top k (topk's order), renormalised to sum 1 where norm_topk_prob
//     pairs    the N * k (token, slot) pairs sorted by expert, tokens ascending within one (a stable counting sort)
//     gather   xs[i] = x[token of pair i]                                        [N k, dim]
//     experts  per active expert e, over its run of pairs: gate_up GEMM -> silu(gate) * up -> down GEMM, every
//              expert's gate_up (then down) in one call (ops.h vnni_gemm_experts_out: decode's in one parallel
//              region, each row quantized once)
//     combine  out[t] = sum over t's pairs in expert order of float(y_i) * w_i, in fp32; one rounding to bf16
//
// The experts' weights lie stacked, expert e at index e of each tensor (moe.py's ExpertStack): one layout for all
// (int8 dot-product codes: W4A8 / W6A8 / W8A8, a K-quant's factored scales too), so a step reads only the routed
// experts' rows of them.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using bf16 = at::BFloat16;
using Stack = c10::List<c10::optional<at::Tensor>>;

using cpuserve_ops::ExpertWeights;

// MoE.route: (weights [N, k] fp32, chosen [N, k] int64)
std::pair<at::Tensor, at::Tensor> route(const at::Tensor& x, const at::Tensor& router, int64_t k, bool norm_topk_prob) {
  const auto logits = at::matmul(x.to(at::kDouble), router.t()).to(at::kFloat);  // logits: [N, E]
  auto [weights, chosen] = at::softmax(logits, -1).topk(k, -1);
  if (norm_topk_prob) weights = weights / weights.sum(-1, true);
  return {weights.contiguous(), chosen.contiguous()};
}

ExpertWeights expert_weights(const Stack& stack, int64_t bits, int64_t act_group, const char* name) {
  TORCH_CHECK(stack.size() == 4, name, " must hold packed, scales, zoffs and supers (or None), got ", stack.size());
  for (int i = 0; i < 3; ++i) TORCH_CHECK(stack.get(i).has_value(), name, "[", i, "] must be a tensor, got None");
  return ExpertWeights{*stack.get(0), *stack.get(1), *stack.get(2), stack.get(3), bits, act_group};
}

// x [N, dim] bf16, router [E, dim] float64 -> [N, dim] bf16
at::Tensor moe_block(const at::Tensor& x, const at::Tensor& router, int64_t k, bool norm_topk_prob,
                     const ExpertWeights& gate_up, const ExpertWeights& down) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x must be contiguous bf16 [N, dim]");
  const int64_t N = x.size(0), dim = x.size(1), E = gate_up.packed.size(0), P = N * k;
  TORCH_CHECK(router.scalar_type() == at::kDouble && router.dim() == 2 && router.size(0) == E && router.size(1) == dim,
              "router must be float64 [E=", E, ", dim=", dim, "]");
  TORCH_CHECK(k >= 1 && k <= E, "k=", k, " experts a token must lie in [1, ", E, "]");
  const int64_t gate_up_n = gate_up.packed.size(1) * 16, down_n = down.packed.size(1) * 16;
  TORCH_CHECK(down.packed.size(0) == E && gate_up_n % 2 == 0 && down_n == dim, "down must have E=", E,
              " experts of ", dim, " outputs, gate_up an even number");
  const auto [weights, chosen] = route(x, router, k, norm_topk_prob);

  // pairs by expert: a stable counting sort of p = t * k + j by chosen[t, j]
  const int64_t* ids = chosen.data_ptr<int64_t>();
  std::vector<int64_t> start(E + 1, 0), order(P);
  for (int64_t p = 0; p < P; ++p) ++start[ids[p] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < P; ++p) order[fill[ids[p]]++] = p;

  auto xs = at::empty({P, dim}, x.options());  // xs: [P, dim], each pair's token row, by expert
  const bf16* xp = x.data_ptr<bf16>();
  bf16* xsp = xs.data_ptr<bf16>();
  for (int64_t i = 0; i < P; ++i) std::memcpy(xsp + i * dim, xp + order[i] / k * dim, dim * sizeof(bf16));
  // every active expert's run of pairs: gate_up GEMMs -> silu(gate) * up -> down GEMMs (decode's in one parallel
  // region a projection, where one a GEMM made 16 a layer)
  std::vector<cpuserve_ops::ExpertRows> runs;
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) runs.push_back({e, start[e], start[e + 1] - start[e]});  // else never read
  auto gate_up_out = at::empty({P, gate_up_n}, x.options());
  auto act = at::empty({P, gate_up_n / 2}, x.options());
  auto ys = at::empty({P, dim}, x.options());
  cpuserve_ops::vnni_gemm_experts_out(xs, gate_up, runs, gate_up_out);
  cpuserve_ops::silu_mul_out(gate_up_out, act);
  cpuserve_ops::vnni_gemm_experts_out(act, down, runs, ys);

  // the reference's y.float() * w, then its index_add_: the product rounded to fp32 before the add (two loops,
  // so that no multiply-add is fused)
  auto acc = at::zeros({N, dim}, x.options().dtype(at::kFloat));
  float* accp = acc.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  const bf16* yp = ys.data_ptr<bf16>();
  std::vector<float> term(dim);
  for (int64_t i = 0; i < P; ++i) {
    const float w = wp[order[i]];
    const bf16* y = yp + i * dim;
    for (int64_t d = 0; d < dim; ++d) term[d] = static_cast<float>(y[d]) * w;
    float* row = accp + order[i] / k * dim;
    for (int64_t d = 0; d < dim; ++d) row[d] += term[d];
  }
  return acc.to(at::kBFloat16);
}

// The op: the stacks as lists [packed, scales, zoffs, supers or None]; meta: gate_up's bits and act_group, then down's
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& router, int64_t k, bool norm_topk_prob,
                       const Stack& gate_up, const Stack& down, at::IntArrayRef meta) {
  TORCH_CHECK(meta.size() == 4, "meta must hold gate_up's bits and act_group, then down's; got ", meta.size());
  return moe_block(x, router, k, norm_topk_prob, expert_weights(gate_up, meta[0], meta[1], "gate_up"),
                   expert_weights(down, meta[2], meta[3], "down"));
}

}  // namespace

at::Tensor cpuserve_ops::moe_experts(const at::Tensor& x, const at::Tensor& router, int64_t k, bool norm_topk_prob,
                                     const ExpertWeights& gate_up, const ExpertWeights& down) {
  return moe_block(x, router, k, norm_topk_prob, gate_up, down);
}

TORCH_LIBRARY_FRAGMENT(cpuserve, m) {
  m.def("moe_experts(Tensor x, Tensor router, int k, bool norm_topk_prob, Tensor?[] gate_up, Tensor?[] down, "
        "int[] meta) -> Tensor");
}

TORCH_LIBRARY_IMPL(cpuserve, CPU, m) { m.impl("moe_experts", &moe_experts); }
