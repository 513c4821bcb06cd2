"""Phi-3's fused projections, split into the Llama names the builder expects (it fuses them again its own way).

    self_attn.qkv_proj.weight [(H + 2 Hkv) D, dim] -> q_proj [H D], k_proj [Hkv D], v_proj [Hkv D]
    mlp.gate_up_proj.weight   [2 F, dim]           -> gate_proj [F] (first half: silu's input), up_proj [F]

Both Hugging Face's Phi3ForCausalLM and llama.cpp's phi3 GGUF (attn_qkv, ffn_up of 2 F rows) store them so.
A weight may be a CodedWeight: its rows split the same way.
"""
from __future__ import annotations

from cpuserve.engine.layers.linear.coded import CodedWeight
from cpuserve.engine.models.args import ModelArgs

FUSED = ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")


def _rows(weight, start: int, end: int):
    if isinstance(weight, CodedWeight):
        return weight.map_rows(lambda t: t[start:end])
    return weight[start:end]


def split_fused(name: str, weight, args: ModelArgs) -> list[tuple[str, object]]:
    """[(name, weight)] with a fused tensor split into its parts; any other tensor as it is."""
    prefix, _, part = name.rpartition(".layers.")
    index, _, rest = part.partition(".")
    if rest not in FUSED:
        return [(name, weight)]
    base = f"{prefix}.layers.{index}."
    if rest == "mlp.gate_up_proj.weight":
        f = weight.shape[0] // 2
        return [(base + "mlp.gate_proj.weight", _rows(weight, 0, f)), (base + "mlp.up_proj.weight", _rows(weight, f, 2 * f))]
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    if weight.shape[0] != q + 2 * kv:
        raise ValueError(f"{name}: {weight.shape[0]} rows, expected (n_heads + 2 n_kv_heads) * head_dim = {q + 2 * kv}")
    return [(base + "self_attn.q_proj.weight", _rows(weight, 0, q)),
            (base + "self_attn.k_proj.weight", _rows(weight, q, q + kv)),
            (base + "self_attn.v_proj.weight", _rows(weight, q + kv, q + 2 * kv))]
