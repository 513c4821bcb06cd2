"""Rotary position embeddings, Hugging Face layout (rotate_half), with Llama 3 frequency scaling, Phi-3's LongRoPE
and partial rotary heads (Phi-4-mini rotates the first 3/4 of each head, the rest passes through).

Partial rotary runs on the same full-head rotation (the C++ rope_write_kv kernel, the fused decode step, apply_rope):
the builder reorders the rows of each q and k head once at load (rotary_order), and the pairs holding pass-through
dims get cos 1 and sin 0, which leave them exactly as they were. q . k is unchanged by the same reorder of both.

    HF head, D dims, RoPE over the first R:   [ a_0 .. a_R/2-1 | b_0 .. b_R/2-1 | p_0 .. p_D-R-1 ]
    engine head, rotate_half over all D:      [ a_0 .. a_R/2-1 | p_0 .. p_(D-R)/2-1 | b_0 .. b_R/2-1 | p_(D-R)/2 .. ]
    pair i = (dim i, dim i + D/2):            i < R/2: (a_i, b_i) at frequency i;  else two p's, cos 1, sin 0
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from cpuserve.engine.models.args import LongRope, ModelArgs


def inv_frequencies(args: ModelArgs, theta: float | None = None, linear_factor: float | None = None,
                    context_len: int | None = None) -> torch.Tensor:
    """Per rotary pair [rotary_dim / 2]; theta / linear_factor: another layer kind's (Gemma 3's local layers), else
    the model's; context_len: the longest sequence the table serves (LongRoPE's factor set: long_rope_factors)."""
    theta = args.rope_theta if theta is None else theta
    factor = args.rope_linear_factor if linear_factor is None else linear_factor
    dim = args.rotary_dim
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)) / factor
    if args.long_rope is not None:
        return (freqs / torch.tensor(long_rope_factors(args.long_rope, context_len), dtype=torch.float64)).float()
    s = args.rope_scaling
    if s is None:
        return freqs.float()
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    scaled = torch.where(wavelen > low_wavelen, freqs / s.factor, freqs)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    scaled = torch.where(mid, (1 - smooth) * freqs / s.factor + smooth * freqs, scaled)
    return scaled.float()


def long_rope_factors(rope: LongRope, context_len: int | None) -> tuple[float, ...]:
    """One set for every position of every sequence: the long factors when the engine's context (max_model_len)
    exceeds original_max_position_embeddings, else the short ones (llama.cpp's rule: n_ctx vs n_ctx_orig).

    transformers re-picks per forward pass by the sequence's current length (and Phi-3's generate recomputes the
    cache when it crosses over); an engine that batches, chunks prefills and reuses cached blocks must rotate a
    position the same way whatever else is in the step, so it fixes the set once, from the context it serves.
    """
    return rope.long_factor if context_len is not None and context_len > rope.original_max_position_embeddings \
        else rope.short_factor


def rope_tables(args: ModelArgs, max_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [max_len, head_dim], halves repeated to match rotate_half, for positions < max_len."""
    scale = args.long_rope.attention_factor if args.long_rope is not None else 1.0
    return rope_at(torch.arange(max_len), inv_frequencies(args, context_len=max_len), dtype, args.head_dim, scale)


def rope_at(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, head_dim: int | None = None,
            attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [N, head_dim] at the given positions [N]; pairs beyond inv_freq's (partial rotary) get cos 1,
    sin 0; attention_factor scales the rotated pairs' (LongRoPE)."""
    angles = torch.outer(positions.to(torch.float32), inv_freq)  # [N, rotary_dim / 2]
    cos, sin = angles.cos() * attention_factor, angles.sin() * attention_factor
    pass_pairs = (head_dim or 2 * inv_freq.numel()) // 2 - inv_freq.numel()
    if pass_pairs:
        cos, sin = F.pad(cos, (0, pass_pairs), value=1.0), F.pad(sin, (0, pass_pairs))  # [N, head_dim / 2]
    return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([sin, sin], dim=-1).to(dtype)  # [N, head_dim]


def rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Engine dim j of a head holds HF dim order[j] (the module docstring's diagram)."""
    half, r2, p2 = head_dim // 2, rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = [*range(r2), *range(rotary_dim, rotary_dim + p2)]  # a's, then the first half of the p's
    second = [*range(r2, rotary_dim), *range(rotary_dim + p2, head_dim)]  # b's, then the rest
    assert len(first) == len(second) == half
    return torch.tensor(first + second)


def reorder_heads(rows: torch.Tensor, head_dim: int, order: torch.Tensor) -> torch.Tensor:
    """rows [heads * head_dim, ...] (a q/k weight, bias) or [head_dim] (a q/k norm): each head's dims in `order`."""
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, head_dim, *rows.shape[1:])[:, order].reshape(rows.shape)  # [heads, D, ...]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D]; cos, sin: [N, 1, D] (already gathered at each token's position)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
