"""Rotary position embeddings, Hugging Face layout (rotate_half), with Llama 3 frequency scaling."""

from __future__ import annotations

import math

import torch

from cpuserve.engine.models.args import ModelArgs


def inv_frequencies(args: ModelArgs, theta: float | None = None, linear_factor: float | None = None) -> torch.Tensor:
    """Per rotary pair; theta / linear_factor: another layer kind's (Gemma 3's local layers), else the model's."""
    theta = args.rope_theta if theta is None else theta
    factor = args.rope_linear_factor if linear_factor is None else linear_factor
    freqs = 1.0 / (theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim)) / factor
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
    return rope_at(torch.arange(max_len), inv_frequencies(args), dtype)


def rope_at(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [N, head_dim] at the given positions [N]."""
    angles = torch.outer(positions.to(torch.float32), inv_freq)  # [N, head_dim / 2]
    angles = torch.cat([angles, angles], dim=-1)  # [N, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D]; cos, sin: [N, 1, D] (already gathered at each token's position)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
