"""Decode steps through every decoder layer in one C++ call (engine/csrc/decode_layers.cpp).

The op-by-op path (llama.py's modules) dispatches a dozen ops per layer from Python; at batch 1 that costs as much
as the matmuls. decode_layers runs the same kernels in the same order, so its result is the op-by-op path's bit
for bit (tests/engine/test_fused_decode.py). It takes a step when

    every scheduled row is a decode (no prefill chunk in the step),
    the kernels are built (CPUSERVE_KERNELS is not torch) with the int8 dot-product GEMMs, activations are bf16,
    every layer is a Llama-family block with W4A8 / W6A8 / W8A8 projections, or StackedLinear ones of them (a
    Q4_K_M qkv: one GEMM per part, into its columns), with Qwen2's biases and Qwen3's q/k norms too, and an MLP
    that is dense or a mixture of experts whose experts stack (moe.py ExpertStack: router and experts in one call),

and CPUSERVE_FUSED_DECODE is not 0. Otherwise, and for replica groups (whose layers call collectives between the
matmuls), the op-by-op path runs.
"""
from __future__ import annotations

import torch
from torch import Tensor

from cpuserve.engine import settings
from cpuserve.engine.layers import ops
from cpuserve.engine.layers.linear.act_int8 import Int8ActLinear
from cpuserve.engine.layers.linear.stacked import StackedLinear

ENV = settings.FUSED_DECODE.name


def enabled() -> bool:
    return settings.FUSED_DECODE.get()


class FusedDecode:
    """The flattened arguments of decode_layers for one model, built once its KV pools are bound."""

    def __init__(self, weights: list[Tensor], linear_meta: list[int], pools: list[Tensor],
                 extras: list[Tensor | None], n_heads: int, eps: float, scale: float):
        self.weights, self.linear_meta, self.pools, self.extras = weights, linear_meta, pools, extras
        self.n_heads, self.eps, self.scale = n_heads, eps, scale

    @classmethod
    def build(cls, model) -> "FusedDecode | None":
        """The model's fused step, or None when some layer does not fit (see the module's docstring)."""
        if not (enabled() and ops.decode_layers_enabled() and model.dtype == torch.bfloat16):
            return None
        weights: list[Tensor] = []
        meta: list[int] = []
        pools: list[Tensor] = []
        extras: list[Tensor | None] = []
        for layer in model.layers:
            att, mlp = layer.attention, layer.mlp
            experts = getattr(mlp, "stack", False)  # a mixture of experts (moe.py): its ExpertStack, or None
            if experts is None:
                return None
            linears = (att.qkv, att.o_proj) + (() if experts else (mlp.gate_up, mlp.down))
            head_norms = [n for n in (att.q_norm, att.k_norm) if n is not None]
            norms = [layer.attention_norm, layer.ffn_norm, *head_norms]
            if att.kv is None or not all(isinstance(lin, (Int8ActLinear, StackedLinear)) for lin in linears) or any(
                    n.eps != model.args.norm_eps or n.weight.dtype != model.dtype for n in norms):
                return None
            weights += [layer.attention_norm.weight, layer.ffn_norm.weight]
            for lin in linears:
                parts = list(lin.parts) if isinstance(lin, StackedLinear) else [lin]
                weights += [t for part in parts for t in _gemm(part)]
                meta += [len(parts), *(v for part in parts for v in (part.bits, part.act_group, _has_supers(part)))]
            if experts:
                weights.append(mlp.router)
                meta += [0, mlp.n_used, int(mlp.norm_topk_prob)]
                for stack, (bits, act_group) in ((experts.gate_up, experts.meta[:2]), (experts.down, experts.meta[2:])):
                    weights += [t for t in stack if t is not None]
                    meta += [bits, act_group, int(stack[3] is not None)]
            pools += [att.kv.kv] if att.kv.scale is None else [att.kv.kv, att.kv.scale]
            biases = [lin.bias for lin in linears] + [None, None] * bool(experts)
            extras += biases + [n.weight if n is not None else None for n in (att.q_norm, att.k_norm)]
        att = model.layers[0].attention
        return cls(weights, meta, pools, extras, att.n_heads, model.args.norm_eps, att.scale)

    def binds(self, model) -> bool:
        """Built over the model's current KV pools (a runner binds them after the model is built)."""
        return self.pools[0] is model.layers[0].attention.kv.kv

    def run(self, x: Tensor, meta) -> Tensor:
        """x [S, dim] bf16, the embeddings of S decode rows -> the hidden states after the last layer."""
        return ops.decode_layers(x, self.weights, self.linear_meta, self.pools, self.extras, meta.cos, meta.sin,
                                 meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens, self.n_heads,
                                 self.eps, self.scale)


def _gemm(linear: Int8ActLinear) -> list[Tensor]:
    return [linear.packed, linear.scales, linear.zoffs] + ([linear.supers] if _has_supers(linear) else [])


def _has_supers(linear: Int8ActLinear) -> int:
    return int(linear.supers is not None)
