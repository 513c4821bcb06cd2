"""Phi-3 / Phi-4-mini RoPE from a Hugging Face config.json or a GGUF's metadata: partial rotary heads and LongRoPE.

    config.json (transformers' Phi3Config)                    GGUF (llama.cpp's convert_hf_to_gguf, Phi3MiniModel)
    rotary_dim = int(head_dim * partial_rotary_factor)        phi3.rope.dimension_count
      (rope_parameters' factor first, else the top level's)
    rope_parameters / rope_scaling of type "longrope" ("su")  rope_factors_long.weight, rope_factors_short.weight
    original_max_position_embeddings (top level, else 4096)   phi3.rope.scaling.original_context_length
    attention_factor, else from factor, else from             phi3.rope.scaling.attn_factor, else from context_length
      max_position_embeddings / original:                       / original_context_length
      sqrt(1 + ln(factor) / ln(original)) when factor > 1, else 1
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from cpuserve.engine.models.args import LongRope

LONGROPE_TYPES = ("longrope", "su")  # "su": the name of early Phi-3 128k configs, which transformers maps to longrope
DEFAULT_ORIGINAL_CONTEXT = 4096  # Phi3Config's default original_max_position_embeddings
FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _attention_factor(max_len: int, original: int, factor: float | None = None) -> float:
    factor = max_len / original if factor is None else factor
    return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0


def hf_fields(config: dict[str, Any], path: str, head_dim: int) -> dict[str, Any]:
    """rotary_dim and long_rope for ModelArgs, read as transformers' Phi3Config reads them."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    partial = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"{path}/config.json: partial_rotary_factor={partial} rotates {rotary_dim} of head_dim="
                         f"{head_dim} dims; it must give an even number in (0, head_dim]")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in LONGROPE_TYPES:
        return {"rotary_dim": rotary_dim}
    original = int(config.get("original_max_position_embeddings", DEFAULT_ORIGINAL_CONTEXT))
    attention = params.get("attention_factor")
    if attention is None:
        factor = params.get("factor")
        attention = _attention_factor(int(config["max_position_embeddings"]), original,
                                      None if factor is None else float(factor))
    short, long = params.get("short_factor"), params.get("long_factor")
    for name, values in (("short_factor", short), ("long_factor", long)):
        if not isinstance(values, list) or len(values) != rotary_dim // 2:
            raise ValueError(f"{path}/config.json: rope_scaling {name} must list {rotary_dim // 2} numbers (one per "
                             f"rotary pair of rotary_dim={rotary_dim}), got {values!r}")
    return {"rotary_dim": rotary_dim, "long_rope": LongRope(tuple(map(float, short)), tuple(map(float, long)),
                                                             original, float(attention))}


def gguf_fields(meta: dict[str, Any], key: Callable[[str], str], factors: Callable[[str], np.ndarray],
                names: set[str], path: str, head_dim: int) -> dict[str, Any]:
    """rotary_dim and long_rope for ModelArgs from a phi3 GGUF; factors(name): a tensor's values."""
    rotary_dim = int(meta.get(key("rope.dimension_count"), head_dim))
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"{path}: {key('rope.dimension_count')}={rotary_dim}; it must be even and in (0, head_dim="
                         f"{head_dim}]")
    present = [n for n in FACTOR_TENSORS if n in names]
    if not present:
        return {"rotary_dim": rotary_dim}
    if len(present) == 1:
        raise ValueError(f"{path}: LongRoPE needs both {' and '.join(FACTOR_TENSORS)}; the file has only {present[0]}")
    original = meta.get(key("rope.scaling.original_context_length"))
    if original is None:
        raise ValueError(f"{path}: {key('rope.scaling.original_context_length')} is missing; LongRoPE "
                         f"({', '.join(FACTOR_TENSORS)}) switches factors at that length")
    attention = meta.get(key("rope.scaling.attn_factor"))
    if attention is None:
        attention = _attention_factor(int(meta[key("context_length")]), int(original))
    long, short = (tuple(float(v) for v in factors(n).reshape(-1)) for n in FACTOR_TENSORS)
    for name, values in zip(FACTOR_TENSORS, (long, short)):
        if len(values) != rotary_dim // 2:
            raise ValueError(f"{path}: tensor {name!r} has {len(values)} values; {key('rope.dimension_count')}="
                             f"{rotary_dim} needs {rotary_dim // 2} (one per rotary pair)")
    return {"rotary_dim": rotary_dim, "long_rope": LongRope(short, long, int(original), float(attention))}
