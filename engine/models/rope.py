"""Rotary position embeddings, Hugging Face layout (rotate_half), with Llama 3 frequency scaling."""

from __future__ import annotations

import math

import torch

from cpuserve.engine.models.args import ModelArgs


def inv_frequencies(args: ModelArgs) -> torch.Tensor:
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
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


def rope_tables(args: ModelArgs, max_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [max_len, head_dim], halves repeated to match rotate_half."""
    t = torch.arange(max_len, dtype=torch.float32)
    angles = torch.outer(t, inv_frequencies(args))  # [max_len, head_dim / 2]
    angles = torch.cat([angles, angles], dim=-1)  # [max_len, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D]; cos, sin: [N, 1, D] (already gathered at each token's position)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
