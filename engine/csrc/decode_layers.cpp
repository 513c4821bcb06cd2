// A decode step through every decoder layer in one call: torch.ops.cpuserve.decode_layers.
//
// At batch 1 the op-by-op path (engine/models/llama.py) spends as long in Python and the dispatcher as in the
// kernels: a dozen module calls and op dispatches per layer, each some microseconds, against GEMMs of tens. This
// strings the very same kernels together in C++ (ops.h: the functions the torch.ops run, called directly) in the
// model's order, so every layer's result is bit for bit the op-by-op path's:
//
//     h = rms_norm(x) -> qkv GEMM -> RoPE + K/V into the pool -> paged decode attention -> o GEMM -> x += o
//     h = rms_norm(x) -> gate_up GEMM -> silu(gate) * up -> down GEMM -> x += down
//
//     (a mixture of experts:  h = rms_norm(x) -> moe_experts (router, routed experts) -> x += out)
//
// Only decode rows (one new token per sequence) and the Llama family's layers with int8 dot-product weights
// (W4A8 / W6A8 / W8A8, or a StackedLinear of them), with Qwen2's biases and Qwen3's q/k norms where the model has
// them, and stacked experts (models/moe.py ExpertStack): engine/models/fused_decode.py checks and otherwise keeps
// the op-by-op path.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kLayerExtras = 6;  // optional: the biases of qkv, o, gate_up, down; q norm, k norm weights

using Extras = c10::List<c10::optional<at::Tensor>>;

// One int8 dot-product GEMM's weights
struct Part {
  const at::Tensor &packed, &scales, &zoffs;
  c10::optional<at::Tensor> supers;  // a K-quant's factored scales
  int64_t bits, act_group;
  int64_t n() const { return packed.size(0) * 16; }
};

// A projection: one GEMM per part (a StackedLinear's row blocks of different storage, each into its own columns
// of out, as the module computes them), then the bias
struct Projection {
  std::vector<Part> parts;
  c10::optional<at::Tensor> bias;
  int64_t n() const {
    int64_t n = 0;
    for (const auto& p : parts) n += p.n();
    return n;
  }
  void operator()(const at::Tensor& x, at::Tensor& out) const {
    int64_t col = 0;
    for (const auto& p : parts) {
      auto cols = out.narrow(1, col, p.n());
      cpuserve_ops::vnni_gemm_out(x, p.packed, p.scales, p.zoffs, p.bits, p.act_group, p.supers, cols);
      col += p.n();
    }
    if (bias.has_value()) out.add_(*bias);  // as the module adds it: in place, in the activation dtype
  }
};

// A mixture of experts' MLP: its router and stacked experts (moe_experts.cpp)
struct Experts {
  const at::Tensor* router;
  int64_t k;
  bool norm_topk_prob;
  cpuserve_ops::ExpertWeights gate_up, down;
};

// Takes the layers' tensors and ints in order (see decode_layers)
struct Reader {
  at::TensorList weights;
  at::IntArrayRef meta;
  size_t w = 0, m = 0;
  const at::Tensor& tensor() {
    TORCH_CHECK(w < weights.size(), "weights hold fewer tensors (", weights.size(), ") than linear_meta describes");
    return weights[w++];
  }
  int64_t value() {
    TORCH_CHECK(m < meta.size(), "linear_meta holds fewer ints (", meta.size(), ") than its part counts describe");
    return meta[m++];
  }
  Projection projection(c10::optional<at::Tensor> bias) {
    const int64_t count = value();
    TORCH_CHECK(count >= 1, "a projection needs at least one part, got ", count);
    Projection p{{}, std::move(bias)};
    for (int64_t i = 0; i < count; ++i) {
      const at::Tensor &packed = tensor(), &scales = tensor(), &zoffs = tensor();
      const int64_t bits = value(), act_group = value();
      const auto supers = value() ? c10::optional<at::Tensor>(tensor()) : c10::nullopt;
      p.parts.push_back(Part{packed, scales, zoffs, supers, bits, act_group});
    }
    return p;
  }
  // gate_up's part count 0 marks a mixture of experts: k, norm_topk_prob, then for gate_up and down bits, act_group,
  // 1 if it has supers; tensors: the router, then each stack's packed, scales, zoffs (and supers)
  c10::optional<Experts> experts() {
    TORCH_CHECK(m < meta.size(), "linear_meta holds fewer ints (", meta.size(), ") than its part counts describe");
    if (meta[m] != 0) return c10::nullopt;
    ++m;
    const at::Tensor* router = &tensor();
    const int64_t k = value();
    const bool norm = value() != 0;
    const auto stack = [&]() {
      const at::Tensor &packed = tensor(), &scales = tensor(), &zoffs = tensor();
      const int64_t bits = value(), act_group = value();
      const auto supers = value() ? c10::optional<at::Tensor>(tensor()) : c10::nullopt;
      return cpuserve_ops::ExpertWeights{packed, scales, zoffs, supers, bits, act_group};
    };
    auto gate_up = stack();
    return Experts{router, k, norm, std::move(gate_up), stack()};
  }
};

struct Layer {
  const at::Tensor *attention_norm, *ffn_norm;
  Projection qkv, o, gate_up, down;  // gate_up, down: no parts where the layer's MLP is experts
  c10::optional<Experts> experts;
};

// Every layer's weights, checked against the counts before any layer runs (a KV pool is written only by a call
// whose arguments are whole)
std::vector<Layer> read_layers(at::TensorList weights, at::IntArrayRef linear_meta, const Extras& extras, int64_t L) {
  Reader reader{weights, linear_meta};
  std::vector<Layer> layers;
  for (int64_t l = 0; l < L; ++l) {
    const auto bias = [&](int64_t i) -> c10::optional<at::Tensor> { return extras.get(l * kLayerExtras + i); };
    const at::Tensor *attention_norm = &reader.tensor(), *ffn_norm = &reader.tensor();
    auto qkv = reader.projection(bias(0));
    auto o = reader.projection(bias(1));
    auto experts = reader.experts();
    auto gate_up = experts ? Projection{} : reader.projection(bias(2));
    auto down = experts ? Projection{} : reader.projection(bias(3));
    layers.push_back(Layer{attention_norm, ffn_norm, std::move(qkv), std::move(o), std::move(gate_up), std::move(down),
                           std::move(experts)});
  }
  TORCH_CHECK(reader.w == weights.size() && reader.m == linear_meta.size(), "weights and linear_meta hold more than ",
              L, " layers describe: ", weights.size(), " tensors, ", linear_meta.size(), " ints");
  return layers;
}

// Qwen3: RMSNorm over each head of heads [S, n, D] (a view into qkv), written back in place
void norm_heads(at::Tensor heads, const c10::optional<at::Tensor>& weight, double eps) {
  if (weight.has_value()) heads.copy_(cpuserve_ops::rms_norm(heads.contiguous(), *weight, eps));
}

// x [S, dim] bf16, one row per sequence. Per layer, in order:
//   weights      attention norm, ffn norm, then for qkv, o, gate_up, down: packed, scales, zoffs (and supers,
//                where the part has them) of each part
//   linear_meta  for qkv, o, gate_up, down: the number of parts, then bits, act_group and 1 if it has supers (else
//                0) of each part
//   (a mixture of experts' layer: after o, a 0 and Reader::experts' ints; its tensors the router and the stacks)
//   pools        the KV pool [blocks, B, 2 Hkv, D], followed by its scales when the pools are int8 (2 per layer)
//   extras       kLayerExtras, None where the model has none
// (one part per projection but where a StackedLinear keeps row blocks of different storage: a Q4_K_M's qkv).
// cos, sin [S, 1, D]; slot_mapping [S] int64; block_tables [S, max_blocks] int32; context_lens [S] int32.
// Returns the hidden states after the last layer (x is not modified).
at::Tensor decode_layers(const at::Tensor& x, at::TensorList weights, at::IntArrayRef linear_meta, at::TensorList pools,
                         const Extras& extras, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t n_heads, double eps,
                         double sm_scale) {
  const int64_t L = static_cast<int64_t>(extras.size()) / kLayerExtras;
  TORCH_CHECK(L > 0 && static_cast<int64_t>(extras.size()) == L * kLayerExtras, "extras must hold ", kLayerExtras,
              " (optional) tensors per layer, got ", extras.size());
  const bool scaled = static_cast<int64_t>(pools.size()) == 2 * L;
  TORCH_CHECK(scaled || static_cast<int64_t>(pools.size()) == L, "pools must hold one pool per layer (", L,
              "), or a pool and its scales (", 2 * L, "), got ", pools.size());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x must be contiguous bf16 [S, dim]");
  const int64_t S = x.size(0), D = pools[0].size(3), Hkv = pools[0].size(2) / 2, heads = n_heads + 2 * Hkv;
  auto h = x.clone();  // the residual stream, updated in place layer by layer
  auto qkv = at::empty({S, heads * D}, x.options());
  auto qkv3 = qkv.view({S, heads, D});
  auto attn = at::empty({S, n_heads * D}, x.options());
  auto attn3 = attn.view({S, n_heads, D});
  auto q = qkv3.narrow(1, 0, n_heads);  // [S, H, D], rows of stride heads * D
  auto proj = at::empty_like(x);        // o's and down's outputs before the residual add
  at::Tensor gate_up, act;
  const std::vector<Layer> layers = read_layers(weights, linear_meta, extras, L);
  for (int64_t l = 0; l < L; ++l) {
    const auto extra = [&](int64_t i) -> c10::optional<at::Tensor> { return extras.get(l * kLayerExtras + i); };
    const Layer& layer = layers[l];
    const at::Tensor &attention_norm = *layer.attention_norm, &ffn_norm = *layer.ffn_norm;
    const Projection &qkv_proj = layer.qkv, &o_proj = layer.o, &gate_up_proj = layer.gate_up, &down_proj = layer.down;
    TORCH_CHECK(qkv_proj.n() == heads * D, "layer ", l, ": qkv has ", qkv_proj.n(), " outputs, expected ", heads * D);
    at::Tensor pool = pools[scaled ? 2 * l : l];
    const c10::optional<at::Tensor> pool_scale = scaled ? c10::optional<at::Tensor>(pools[2 * l + 1]) : c10::nullopt;

    qkv_proj(cpuserve_ops::rms_norm(h, attention_norm, eps), qkv);
    norm_heads(qkv3.narrow(1, 0, n_heads), extra(4), eps);
    norm_heads(qkv3.narrow(1, n_heads, Hkv), extra(5), eps);
    cpuserve_ops::rope_write_kv(qkv3, cos, sin, n_heads, pool, pool_scale, slot_mapping);
    cpuserve_ops::decode_attention_out(q, pool, pool_scale, block_tables, context_lens, sm_scale, attn3);
    o_proj(attn, proj);
    h.add_(proj);

    if (layer.experts) {  // router and routed experts in one call
      const Experts& ex = *layer.experts;
      h.add_(cpuserve_ops::moe_experts(cpuserve_ops::rms_norm(h, ffn_norm, eps), *ex.router, ex.k, ex.norm_topk_prob,
                                       ex.gate_up, ex.down));
      continue;
    }
    if (!gate_up.defined() || gate_up.size(1) != gate_up_proj.n()) {
      gate_up = at::empty({S, gate_up_proj.n()}, x.options());
      act = at::empty({S, gate_up_proj.n() / 2}, x.options());
    }
    gate_up_proj(cpuserve_ops::rms_norm(h, ffn_norm, eps), gate_up);
    cpuserve_ops::silu_mul_out(gate_up, act);
    down_proj(act, proj);
    h.add_(proj);
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cpuserve, m) {
  m.def("decode_layers(Tensor x, Tensor[] weights, int[] linear_meta, Tensor[] pools, Tensor?[] extras, Tensor cos, Tensor sin, "
        "Tensor slot_mapping, Tensor block_tables, Tensor context_lens, int n_heads, float eps, float sm_scale) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(cpuserve, CPU, m) { m.impl("decode_layers", &decode_layers); }
