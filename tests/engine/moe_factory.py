"""Mixture-of-experts pieces of the tiny test models (arch_factory.py builds them): the configs, and the experts
written into a GGUF as llama.cpp's convert_hf_to_gguf writes them (stacked per layer, in any block type).

    MOE_EXTRA["qwen3moe"]                                   # transformers config fields of the tiny model
    add_moe_metadata(writer, model.config, "qwen3moe")      # expert_count, expert_used_count, ...
    types = write_experts(writer, model, qtype="Q4_K")      # ffn_{gate,up,down}_exps; the model's experts become
                                                            # gguf's own dequantization of the blocks written
"""
from __future__ import annotations

import gguf
import numpy as np
import torch
from kquant_factory import bench_module

QT = gguf.GGMLQuantizationType
EXPERTS, USED = 8, 2
MOE_EXTRA = {
    "mixtral": dict(num_local_experts=EXPERTS, num_experts_per_tok=USED, sliding_window=None, rope_theta=1e6),
    "qwen3moe": dict(head_dim=48, num_experts=EXPERTS, num_experts_per_tok=USED, moe_intermediate_size=64,
                     norm_topk_prob=True, tie_word_embeddings=True),
    # Qwen3-MoE's transformers default: the top-k softmax weights as they are, not renormalised
    "qwen3moe-raw-topk": dict(num_experts=EXPERTS, num_experts_per_tok=3, moe_intermediate_size=64,
                              norm_topk_prob=False),
}
GGUF_QUANTIZES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # gguf.quants encodes these; K-quants: random blocks
# the GGUF name of each expert tensor and its [E, rows, K] slice of transformers' gate_up_proj / down_proj
STACKED = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def is_expert_state(hf: str) -> bool:
    return ".mlp.experts." in hf


def add_moe_metadata(writer: gguf.GGUFWriter, cfg, arch: str) -> None:
    writer.add_expert_count(cfg.num_experts if arch == "qwen3moe" else cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if not cfg.norm_topk_prob:
            writer.add_expert_weights_norm(False)


def _stacks(model) -> list[tuple[int, str, torch.Tensor]]:
    """(layer, GGUF suffix, [E, rows, K] parameter view) of every expert tensor."""
    out = []
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        f = experts.gate_up_proj.shape[1] // 2  # gate_up_proj: [E, 2 F, dim], gate first
        views = (experts.gate_up_proj.data[:, :f], experts.gate_up_proj.data[:, f:], experts.down_proj.data)
        out += [(i, name, view) for name, view in zip(STACKED, views)]
    return out


def write_experts(writer: gguf.GGUFWriter, model, qtype: str | dict[str, str] | None = None,
                  seed: int = 0) -> dict[str, QT]:
    """Add every layer's stacked experts to writer: F32 (qtype None), or blocks of qtype (one type, or a type per
    GGUF suffix). Coded experts replace the model's own by gguf's dequantization of the blocks written, so the
    model is then the reference of the file. Returns the type of each tensor written."""
    rng = np.random.default_rng(seed)
    types = {}
    for i, suffix, view in _stacks(model):
        name = f"blk.{i}.{suffix}"
        t = qtype.get(suffix) if isinstance(qtype, dict) else qtype
        array = view.float().numpy()
        if t is None:
            writer.add_tensor(name, np.ascontiguousarray(array))
            types[name] = QT.F32
            continue
        qt, (e, rows, k) = QT[t], array.shape
        if t in GGUF_QUANTIZES:
            blocks = gguf.quants.quantize(array.reshape(e * rows, k), qt)
        else:  # std 0.1: the scale of the model's other weights (initializer_range)
            blocks = bench_module("kquant_recipe").random_blocks(qt, (e * rows, k), rng, std=0.1)
        view.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qt).reshape(e, rows, k)))
        writer.add_tensor(name, blocks.reshape(e, rows, -1), raw_dtype=qt)
        types[name] = qt
    return types
