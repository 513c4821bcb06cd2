// A mixture-of-experts layer's routed experts in one call: torch.ops.cpuserve.moe_experts.
//
// engine/models/moe.py's reference runs each active expert from Python: a gather, two GEMMs and silu(gate) * up
// per expert, then a weighted add per expert; at one decode row (Qwen3-30B-A3B: 8 experts a layer) that is ~40
// dispatches a layer for GEMMs of some tens of microseconds. This runs the very same kernels (ops.h) in the same
// order, so its result is the reference's bit for bit (tests/engine/test_moe.py):
//
//     route    moe.py's MoE.route in the same ops: logits = x times the router, fp32 (dense_gemm: each row's bits
//              independent of N; a float64 router where that is not built: torch's matmul in float64, rounded to
//              fp32); softmax over all experts, the top k (topk's order), renormalised to sum 1 where norm_topk_prob
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
//
// A replica group's rank holds a contiguous run of the experts (engine/distributed/experts.py): moe_expert_rows
// routes over all of them and runs its own, moe_combine adds the pairs of a run of experts. One rank's moe_experts
// is moe_expert_rows over every expert, then moe_combine over every expert, in the same order.

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

// ops.router_logits: x [N, dim] bf16 -> [N, E] fp32
at::Tensor router_logits(const at::Tensor& x, const at::Tensor& router) {
  if (router.scalar_type() == at::kDouble) return at::matmul(x.to(at::kDouble), router.t()).to(at::kFloat);
  auto logits = at::empty({x.size(0), router.size(0)}, x.options().dtype(at::kFloat));
  return cpuserve_ops::dense_gemm_out(x.to(at::kFloat), router, c10::nullopt, logits);
}

// MoE.route: (weights [N, k] fp32, chosen [N, k] int64)
std::pair<at::Tensor, at::Tensor> route(const at::Tensor& x, const at::Tensor& router, int64_t k, bool norm_topk_prob) {
  const auto logits = router_logits(x, router);  // logits: [N, E]
  auto [weights, chosen] = at::softmax(logits, -1).topk(k, -1);
  if (norm_topk_prob) weights = weights / weights.sum(-1, true);
  return {weights.contiguous(), chosen.contiguous()};
}

ExpertWeights expert_weights(const Stack& stack, int64_t bits, int64_t act_group, const char* name) {
  TORCH_CHECK(stack.size() == 4, name, " must hold packed, scales, zoffs and supers (or None), got ", stack.size());
  for (int i = 0; i < 3; ++i) TORCH_CHECK(stack.get(i).has_value(), name, "[", i, "] must be a tensor, got None");
  return ExpertWeights{*stack.get(0), *stack.get(1), *stack.get(2), stack.get(3), bits, act_group};
}

// One step's routing: MoE.route's weights, and the N * k (token, slot) pairs p = t * k + j sorted by expert (a
// stable counting sort: tokens ascending within an expert), expert e's pairs at order[start[e], start[e + 1])
struct Routing {
  at::Tensor weights;  // [N, k] fp32
  at::Tensor order;    // [N k] int64
  at::Tensor start;    // [E + 1] int64
};

Routing sort_pairs(const at::Tensor& x, const at::Tensor& router, int64_t k, bool norm_topk_prob) {
  const int64_t E = router.size(0), P = x.size(0) * k;
  const auto [weights, chosen] = route(x, router, k, norm_topk_prob);
  const int64_t* ids = chosen.data_ptr<int64_t>();
  auto start_t = at::zeros({E + 1}, at::kLong), order_t = at::empty({P}, at::kLong);
  int64_t* start = start_t.data_ptr<int64_t>();
  int64_t* order = order_t.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) ++start[ids[p] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start, start + E);
  for (int64_t p = 0; p < P; ++p) order[fill[ids[p]]++] = p;
  return {weights, order_t, start_t};
}

// The rows of experts [first, first + E_local) (the stacks hold those, expert first at index 0): each pair's
// token row through its expert, [start[first + E_local] - start[first], dim] bf16 in pair order
at::Tensor expert_rows(const at::Tensor& x, const Routing& r, int64_t k, int64_t first, const ExpertWeights& gate_up,
                       const ExpertWeights& down) {
  const int64_t dim = x.size(1), E_local = gate_up.packed.size(0);
  const int64_t gate_up_n = gate_up.packed.size(1) * 16, down_n = down.packed.size(1) * 16;
  const int64_t* start = r.start.data_ptr<int64_t>();
  const int64_t* order = r.order.data_ptr<int64_t>();
  TORCH_CHECK(first >= 0 && first + E_local < r.start.size(0), "experts [", first, ", ", first + E_local,
              ") must lie within the router's ", r.start.size(0) - 1);
  TORCH_CHECK(down.packed.size(0) == E_local && gate_up_n % 2 == 0 && down_n == dim, "down must have E=", E_local,
              " experts of ", dim, " outputs, gate_up an even number");
  const int64_t p0 = start[first], Q = start[first + E_local] - p0;
  auto xs = at::empty({Q, dim}, x.options());  // xs: [Q, dim], each local pair's token row, by expert
  const bf16* xp = x.data_ptr<bf16>();
  bf16* xsp = xs.data_ptr<bf16>();
  for (int64_t i = 0; i < Q; ++i) std::memcpy(xsp + i * dim, xp + order[p0 + i] / k * dim, dim * sizeof(bf16));
  // every active local expert's run of pairs: gate_up GEMMs -> silu(gate) * up -> down GEMMs (decode's in one
  // parallel region a projection, where one a GEMM made 16 a layer)
  std::vector<cpuserve_ops::ExpertRows> runs;
  for (int64_t e = 0; e < E_local; ++e) {
    const int64_t a = start[first + e] - p0, count = start[first + e + 1] - start[first + e];
    if (count) runs.push_back({e, a, count});  // else not routed to: its weights are never read
  }
  auto gate_up_out = at::empty({Q, gate_up_n}, x.options());
  auto act = at::empty({Q, gate_up_n / 2}, x.options());
  auto ys = at::empty({Q, dim}, x.options());
  if (runs.empty()) return ys;
  cpuserve_ops::vnni_gemm_experts_out(xs, gate_up, runs, gate_up_out);
  cpuserve_ops::silu_mul_out(gate_up_out, act);
  cpuserve_ops::vnni_gemm_experts_out(act, down, runs, ys);
  return ys;
}

// acc [N, dim] fp32 (zeroed here) = the sum of the pairs of experts [first, stop) (ys' rows, in pair order):
// the reference's y.float() * w, then its index_add_: the product rounded to fp32 before the add (two loops, so
// that no multiply-add is fused)
void combine(const at::Tensor& ys, const Routing& r, int64_t k, int64_t first, int64_t stop, at::Tensor& acc) {
  const int64_t* start = r.start.data_ptr<int64_t>();
  const int64_t* order = r.order.data_ptr<int64_t>();
  const int64_t dim = acc.size(1), p0 = start[first], Q = start[stop] - p0;
  TORCH_CHECK(ys.dim() == 2 && ys.size(0) == Q && ys.size(1) == dim && ys.scalar_type() == at::kBFloat16 &&
              ys.is_contiguous(), "ys must be contiguous bf16 [", Q, ", ", dim, "], got ", ys.sizes());
  acc.zero_();
  float* accp = acc.data_ptr<float>();
  const float* wp = r.weights.data_ptr<float>();
  const bf16* yp = ys.data_ptr<bf16>();
  std::vector<float> term(dim);
  for (int64_t i = 0; i < Q; ++i) {
    const int64_t p = order[p0 + i];
    const float w = wp[p];
    const bf16* y = yp + i * dim;
    for (int64_t d = 0; d < dim; ++d) term[d] = static_cast<float>(y[d]) * w;
    float* row = accp + p / k * dim;
    for (int64_t d = 0; d < dim; ++d) row[d] += term[d];
  }
}

void check_inputs(const at::Tensor& x, const at::Tensor& router, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x must be contiguous bf16 [N, dim]");
  const int64_t E = router.size(0);
  TORCH_CHECK((router.scalar_type() == at::kFloat || router.scalar_type() == at::kDouble) && router.dim() == 2 &&
                  router.size(1) == x.size(1) && router.is_contiguous(),
              "router must be contiguous fp32 or float64 [E, dim=", x.size(1), "]");
  TORCH_CHECK(k >= 1 && k <= E, "k=", k, " experts a token must lie in [1, ", E, "]");
}

// x [N, dim] bf16, router [E, dim] fp32 (or float64), every expert stacked -> [N, dim] bf16
at::Tensor moe_block(const at::Tensor& x, const at::Tensor& router, int64_t k, bool norm_topk_prob,
                     const ExpertWeights& gate_up, const ExpertWeights& down) {
  check_inputs(x, router, k);
  const int64_t E = router.size(0);
  TORCH_CHECK(gate_up.packed.size(0) == E, "gate_up must stack the router's E=", E, " experts");
  const Routing r = sort_pairs(x, router, k, norm_topk_prob);
  const auto ys = expert_rows(x, r, k, 0, gate_up, down);
  auto acc = at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kFloat));
  combine(ys, r, k, 0, E, acc);
  return acc.to(at::kBFloat16);
}

// The op: the stacks as lists [packed, scales, zoffs, supers or None]; meta: gate_up's bits and act_group, then down's
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& router, int64_t k, bool norm_topk_prob,
                       const Stack& gate_up, const Stack& down, at::IntArrayRef meta) {
  TORCH_CHECK(meta.size() == 4, "meta must hold gate_up's bits and act_group, then down's; got ", meta.size());
  return moe_block(x, router, k, norm_topk_prob, expert_weights(gate_up, meta[0], meta[1], "gate_up"),
                   expert_weights(down, meta[2], meta[3], "down"));
}

// A replica group's rank (engine/distributed/experts.py): route over every expert, run this rank's experts
// [first, first + E_local) (the stacks') -> (ys [its pairs, dim] bf16, weights [N, k], order [N k], start [E + 1])
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_expert_rows(
    const at::Tensor& x, const at::Tensor& router, int64_t k, bool norm_topk_prob, const Stack& gate_up,
    const Stack& down, at::IntArrayRef meta, int64_t first) {
  TORCH_CHECK(meta.size() == 4, "meta must hold gate_up's bits and act_group, then down's; got ", meta.size());
  check_inputs(x, router, k);
  const Routing r = sort_pairs(x, router, k, norm_topk_prob);
  auto ys = expert_rows(x, r, k, first, expert_weights(gate_up, meta[0], meta[1], "gate_up"),
                        expert_weights(down, meta[2], meta[3], "down"));
  return {ys, r.weights, r.order, r.start};
}

// out [N, dim] fp32 = the weighted sum of the pairs of experts [first, stop), ys their rows (moe_expert_rows' own,
// or every rank's gathered)
void moe_combine(const at::Tensor& ys, const at::Tensor& weights, const at::Tensor& order, const at::Tensor& start,
                 int64_t first, int64_t stop, at::Tensor out) {
  const int64_t N = weights.size(0), k = weights.size(1), E = start.size(0) - 1;
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && order.scalar_type() == at::kLong &&
              order.numel() == N * k && start.scalar_type() == at::kLong && order.is_contiguous() &&
              start.is_contiguous(), "weights [N, k] fp32, order [N k] and start [E + 1] int64, contiguous");
  TORCH_CHECK(0 <= first && first <= stop && stop <= E, "experts [", first, ", ", stop, ") must lie in [0, ", E, "]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == N && out.is_contiguous(),
              "out must be contiguous fp32 [N=", N, ", dim]");
  combine(ys, Routing{weights, order, start}, k, first, stop, out);
}

}  // namespace

at::Tensor cpuserve_ops::moe_experts(const at::Tensor& x, const at::Tensor& router, int64_t k, bool norm_topk_prob,
                                     const ExpertWeights& gate_up, const ExpertWeights& down) {
  return moe_block(x, router, k, norm_topk_prob, gate_up, down);
}

TORCH_LIBRARY_FRAGMENT(cpuserve, m) {
  m.def("moe_experts(Tensor x, Tensor router, int k, bool norm_topk_prob, Tensor?[] gate_up, Tensor?[] down, "
        "int[] meta) -> Tensor");
  m.def("moe_expert_rows(Tensor x, Tensor router, int k, bool norm_topk_prob, Tensor?[] gate_up, Tensor?[] down, "
        "int[] meta, int first) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_combine(Tensor ys, Tensor weights, Tensor order, Tensor start, int first, int stop, Tensor(a!) out) "
        "-> ()");
}

TORCH_LIBRARY_IMPL(cpuserve, CPU, m) {
  m.impl("moe_experts", &moe_experts);
  m.impl("moe_expert_rows", &moe_expert_rows);
  m.impl("moe_combine", &moe_combine);
}
