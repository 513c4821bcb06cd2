"""Llama 3 RoPE scaling, recovered from the `rope_freqs.weight` tensor of a GGUF.

llama.cpp's converter does not store Llama 3's rope_scaling parameters; it stores their result, one
frequency divisor per rotary dimension pair. Our engine takes the parameters (ModelArgs.rope_scaling), so we
take the factor from the tensor, the other three from metadata when present or Llama 3.1's published values,
recompute the divisors, and accept them only if they reproduce the tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from cpuserve.engine.models.args import RopeScaling

# Llama 3.1/3.2/3.3 all ship these (config.json rope_scaling); only `factor` differs between them
DEFAULT_LOW_FREQ_FACTOR = 1.0
DEFAULT_HIGH_FREQ_FACTOR = 4.0
DEFAULT_ORIGINAL_CONTEXT = 8192


def llama3_freq_divisors(scaling: RopeScaling, theta: float, rotary_dim: int) -> np.ndarray:
    """Per-pair divisor of the base frequency, as Llama 3's rope_scaling defines it (1 = unscaled)."""
    inv_freq = theta ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    medium = 1.0 / ((1 - smooth) / scaling.factor + smooth)
    # short wavelengths keep their frequency, long ones are slowed by `factor`, the band between is blended
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, scaling.factor, medium))


def rope_scaling_from_freqs(freqs: np.ndarray, meta: dict[str, Any], key: Callable[[str], str], path: str) -> RopeScaling:
    theta = float(meta.get(key("rope.freq_base"), 10000.0))
    scaling = RopeScaling(
        factor=float(freqs.max()),
        low_freq_factor=float(meta.get(key("rope.scaling.low_freq_factor"), DEFAULT_LOW_FREQ_FACTOR)),
        high_freq_factor=float(meta.get(key("rope.scaling.high_freq_factor"), DEFAULT_HIGH_FREQ_FACTOR)),
        original_max_position_embeddings=int(
            meta.get(key("rope.scaling.original_context_length"), DEFAULT_ORIGINAL_CONTEXT)
        ),
    )
    expected = llama3_freq_divisors(scaling, theta, 2 * len(freqs))
    if not np.allclose(expected, freqs, rtol=1e-3):
        raise ValueError(
            f"{path}: tensor rope_freqs.weight does not match Llama 3 rope scaling with {scaling} "
            f"(rope.freq_base={theta}); only llama3-type scaling is supported"
        )
    return scaling
