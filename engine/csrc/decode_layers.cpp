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
// Only decode rows (one new token per sequence) and the Llama family's layers with int8 dot-product weights
// (W4A8 / W8A8), with Qwen2's biases and Qwen3's q/k norms where the model has them: engine/models/fused_decode.py
// checks and otherwise keeps the op-by-op path.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kLayerTensors = 14;  // attention norm, qkv (packed, scales, zoffs), o (3), ffn norm, gate_up, down
constexpr int64_t kLayerInts = 8;      // bits and act_group of qkv, o, gate_up, down
constexpr int64_t kLayerExtras = 6;    // optional: the biases of qkv, o, gate_up, down; q norm, k norm weights

using Extras = c10::List<c10::optional<at::Tensor>>;

struct Gemm {
  const at::Tensor &packed, &scales, &zoffs;
  int64_t bits, act_group;
  c10::optional<at::Tensor> bias;
  int64_t n() const { return packed.size(0) * 16; }
  void operator()(const at::Tensor& x, at::Tensor& out) const {
    cpuserve_ops::vnni_gemm_out(x, packed, scales, zoffs, bits, act_group, out);
    if (bias.has_value()) out.add_(*bias);  // as the module adds it: in place, in the activation dtype
  }
};

// Qwen3: RMSNorm over each head of heads [S, n, D] (a view into qkv), written back in place
void norm_heads(at::Tensor heads, const c10::optional<at::Tensor>& weight, double eps) {
  if (weight.has_value()) heads.copy_(cpuserve_ops::rms_norm(heads.contiguous(), *weight, eps));
}

// x [S, dim] bf16, one row per sequence; weights: kLayerTensors per layer; linear_meta: kLayerInts per layer;
// pools: per layer the KV pool [blocks, B, 2 Hkv, D], followed by its scales when the pools are int8 (2 per layer);
// extras: kLayerExtras per layer, None where the model has none.
// cos, sin [S, 1, D]; slot_mapping [S] int64; block_tables [S, max_blocks] int32; context_lens [S] int32.
// Returns the hidden states after the last layer (x is not modified).
at::Tensor decode_layers(const at::Tensor& x, at::TensorList weights, at::IntArrayRef linear_meta, at::TensorList pools,
                         const Extras& extras, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t n_heads, double eps,
                         double sm_scale) {
  const int64_t L = static_cast<int64_t>(weights.size()) / kLayerTensors;
  TORCH_CHECK(L > 0 && static_cast<int64_t>(weights.size()) == L * kLayerTensors,
              "weights must hold ", kLayerTensors, " tensors per layer, got ", weights.size());
  TORCH_CHECK(static_cast<int64_t>(linear_meta.size()) == L * kLayerInts, "linear_meta must hold ", kLayerInts,
              " ints per layer (", L * kLayerInts, "), got ", linear_meta.size());
  TORCH_CHECK(static_cast<int64_t>(extras.size()) == L * kLayerExtras, "extras must hold ", kLayerExtras,
              " (optional) tensors per layer (", L * kLayerExtras, "), got ", extras.size());
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
  for (int64_t l = 0; l < L; ++l) {
    const auto* w = weights.data() + l * kLayerTensors;
    const auto* m = linear_meta.data() + l * kLayerInts;
    const auto extra = [&](int64_t i) -> c10::optional<at::Tensor> { return extras.get(l * kLayerExtras + i); };
    const Gemm qkv_proj{w[1], w[2], w[3], m[0], m[1], extra(0)}, o_proj{w[4], w[5], w[6], m[2], m[3], extra(1)};
    const Gemm gate_up_proj{w[8], w[9], w[10], m[4], m[5], extra(2)};
    const Gemm down_proj{w[11], w[12], w[13], m[6], m[7], extra(3)};
    TORCH_CHECK(qkv_proj.n() == heads * D, "layer ", l, ": qkv has ", qkv_proj.n(), " outputs, expected ", heads * D);
    at::Tensor pool = pools[scaled ? 2 * l : l];
    const c10::optional<at::Tensor> pool_scale = scaled ? c10::optional<at::Tensor>(pools[2 * l + 1]) : c10::nullopt;

    qkv_proj(cpuserve_ops::rms_norm(h, w[0], eps), qkv);
    norm_heads(qkv3.narrow(1, 0, n_heads), extra(4), eps);
    norm_heads(qkv3.narrow(1, n_heads, Hkv), extra(5), eps);
    cpuserve_ops::rope_write_kv(qkv3, cos, sin, n_heads, pool, pool_scale, slot_mapping);
    cpuserve_ops::decode_attention_out(q, pool, pool_scale, block_tables, context_lens, sm_scale, attn3);
    o_proj(attn, proj);
    h.add_(proj);

    if (!gate_up.defined() || gate_up.size(1) != gate_up_proj.n()) {
      gate_up = at::empty({S, gate_up_proj.n()}, x.options());
      act = at::empty({S, gate_up_proj.n() / 2}, x.options());
    }
    gate_up_proj(cpuserve_ops::rms_norm(h, w[7], eps), gate_up);
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
