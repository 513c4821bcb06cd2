"""Gemma 3 (text) hyper-parameters from a Hugging Face config.json or a GGUF's metadata, and its checkpoint quirks.

Both loaders hand the model Gemma's RMSNorm multiplier (1 + weight): llama.cpp's converter stores it so in a
GGUF; from safetensors (which store `weight`) norm_multiplier adds the 1.

Where a GGUF keeps no value llama.cpp fixes it as its own Gemma 3 code does: every 6th layer global (unless the
file has attention.sliding_window_pattern), the local layers' RoPE base 10000, the softmax scale head_dim ** -0.5
(27B, 62 layers: (dim / n_heads) ** -0.5).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cpuserve.engine.models.args import SlidingWindow

LAYER_TYPES = ("sliding_attention", "full_attention")
DEFAULT_PATTERN = 6  # transformers' sliding_window_pattern default and llama.cpp's fixed one: 5 local, 1 global
LOCAL_ROPE_THETA = 10000.0
GLOBAL_ROPE_THETA = 1_000_000.0
GGUF_27B_LAYERS = 62  # llama.cpp scales Gemma 3 27B's queries by (dim / n_heads) ** -0.5, the others by head_dim's


def norm_multiplier(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm multiplies by (1 + weight): a safetensors norm weight becomes that multiplier."""
    return tensor + 1.0 if name.endswith("norm.weight") else tensor  # the four block norms, q/k norms, final norm


def _refuse_unsupported(config: dict[str, Any], where: str) -> None:
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(name) is not None:
            raise ValueError(f"{where}: {name}={config[name]} is not supported; supported: null (Gemma 3 has none)")
    if config.get("use_bidirectional_attention"):
        raise ValueError(f"{where}: use_bidirectional_attention=true is not supported; supported: false (causal)")
    if config.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias=true is not supported for Gemma3ForCausalLM")
    activation = config.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"{where}: hidden_activation={activation!r} is not supported; supported: 'gelu_pytorch_tanh'")


def _layer_types(config: dict[str, Any], n_layers: int, where: str) -> list[str]:
    pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or DEFAULT_PATTERN)
    types = config.get("layer_types") or [LAYER_TYPES[(i + 1) % pattern == 0] for i in range(n_layers)]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown or len(types) != n_layers:
        raise ValueError(f"{where}: layer_types must list {n_layers} of {list(LAYER_TYPES)}, got {types}")
    return types


def _rope(config: dict[str, Any], where: str) -> tuple[float, float, float]:
    """(global theta, global linear factor, local theta), from transformers 5's per-layer-type rope_parameters or
    older configs' rope_theta / rope_scaling / rope_local_base_freq."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params:
        full, local = params["full_attention"] or {}, params.get("sliding_attention") or {}
    else:
        full = {"rope_theta": config.get("rope_theta", GLOBAL_ROPE_THETA), **(config.get("rope_scaling") or {})}
        local = {"rope_theta": config.get("rope_local_base_freq", LOCAL_ROPE_THETA)}
    full_type = full.get("rope_type", full.get("type", "default"))
    if full_type not in ("default", "linear"):
        raise ValueError(f"{where}: rope type {full_type!r} of the full-attention layers is not supported; "
                         "supported: default, linear")
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type != "default":
        raise ValueError(f"{where}: rope type {local_type!r} of the sliding-window layers is not supported; "
                         "supported: default")
    factor = float(full.get("factor", 1.0)) if full_type == "linear" else 1.0
    return (float(full.get("rope_theta", GLOBAL_ROPE_THETA)), factor,
            float(local.get("rope_theta", LOCAL_ROPE_THETA)))


def hf_fields(config: dict[str, Any], path: str) -> dict[str, Any]:
    """ModelArgs fields of a Gemma3ForCausalLM config.json beyond the Llama ones (overriding theirs)."""
    where = f"{path}/config.json"
    _refuse_unsupported(config, where)
    n_layers = int(config["num_hidden_layers"])
    types = _layer_types(config, n_layers, where)
    theta, factor, local_theta = _rope(config, where)
    window = int(config.get("sliding_window") or 4096)
    head_dim = int(config.get("head_dim") or 256)
    return dict(
        head_dim=head_dim,
        max_seq_len=int(config.get("max_position_embeddings", 131072)),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=None,
        rope_linear_factor=factor,
        tie_embeddings=bool(config.get("tie_word_embeddings", True)),
        qk_norm=True,
        attn_scale=float(config.get("query_pre_attn_scalar", head_dim)) ** -0.5,
        sliding_window=SlidingWindow(window, tuple(t == "sliding_attention" for t in types), local_theta),
    )


def gguf_fields(meta: dict[str, Any], key: Callable[[str], str], path: str, n_layers: int, dim: int, n_heads: int,
                head_dim: int) -> dict[str, Any]:
    """ModelArgs fields of a `gemma3` GGUF beyond the Llama ones."""
    _refuse_unsupported({name: meta.get(key(name)) for name in ("final_logit_softcapping", "attn_logit_softcapping")},
                        path)
    window = meta.get(key("attention.sliding_window"))
    if not window:
        raise ValueError(f"{path}: required GGUF metadata key {key('attention.sliding_window')!r} is missing")
    scaling = meta.get(key("rope.scaling.type"), "none")  # checked by gguf.py: none or linear
    factor = float(meta.get(key("rope.scaling.factor"), 1.0))
    scale_dim = dim // n_heads if n_layers == GGUF_27B_LAYERS else head_dim
    pattern = meta.get(key("attention.sliding_window_pattern"), DEFAULT_PATTERN)  # llama.cpp: 6 when absent
    if isinstance(pattern, list):  # one flag per layer, True = sliding-window
        if len(pattern) != n_layers:
            raise ValueError(f"{path}: {key('attention.sliding_window_pattern')} has {len(pattern)} flags for "
                             f"{n_layers} layers")
        layers = tuple(bool(p) for p in pattern)
    else:
        layers = tuple((i + 1) % int(pattern) != 0 for i in range(n_layers))
    return dict(
        rope_linear_factor=factor if scaling == "linear" else 1.0,
        qk_norm=True,
        attn_scale=float(scale_dim) ** -0.5,
        sliding_window=SlidingWindow(int(window), layers, LOCAL_ROPE_THETA),
    )
