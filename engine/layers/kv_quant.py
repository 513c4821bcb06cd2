"""Paged KV cache I/O: per-(token, kv head) int8 quantization, scatter of new tokens, gather of one context.

Cache layout per layer (allocated by the runner; the model holds it as LayerKV, K and V in one tensor):

    k_cache, v_cache: [num_blocks, block_size B, n_kv_heads, head_dim]   int8 | bf16 | fp32
    k_scale, v_scale: [num_blocks, B, n_kv_heads] fp32 for int8 caches, else None

    token at position p of a sequence -> block block_table[p // B], offset p % B
    slot = block_id * B + offset  (row of the cache viewed as [num_blocks * B, n_kv_heads, head_dim])
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

INT8_MAX = 127.0
_MIN_SCALE = 1e-30  # an all-zero vector gets a tiny scale, so quantizing it divides 0 by a non-zero number


@dataclass(slots=True)
class LayerKV:
    """One layer's pool. K heads and V heads sit side by side so a step writes both with one scatter.

        kv:    [num_blocks, block_size, 2 * n_kv_heads, head_dim]   (K heads 0..Hkv-1, then V heads)
        scale: [num_blocks, block_size, 2 * n_kv_heads] fp32 for int8 caches, else None
    """

    kv: torch.Tensor
    scale: torch.Tensor | None

    @property
    def num_kv_heads(self) -> int:
        return self.kv.shape[2] // 2

    @property
    def k(self) -> torch.Tensor:
        return self.kv[:, :, : self.num_kv_heads]  # [num_blocks, B, Hkv, D] view

    @property
    def v(self) -> torch.Tensor:
        return self.kv[:, :, self.num_kv_heads:]

    @property
    def k_scale(self) -> torch.Tensor | None:
        return None if self.scale is None else self.scale[:, :, : self.num_kv_heads]

    @property
    def v_scale(self) -> torch.Tensor | None:
        return None if self.scale is None else self.scale[:, :, self.num_kv_heads:]


def quantize_kv(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric absmax/127 int8 quantization, one scale per (token, kv head).

    Args:
        x: [N, Hkv, D] float.
    Returns:
        (int8 [N, Hkv, D], scale fp32 [N, Hkv]); x ~= q * scale[..., None], |error| <= scale / 2.
    """
    xf = x.float()
    scale = (xf.abs().amax(-1) / INT8_MAX).clamp_(min=_MIN_SCALE)
    q = torch.round(xf / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def write_kv(k_cache: Tensor, k_scale: Tensor | None, v_cache: Tensor, v_scale: Tensor | None,
             k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Store new tokens' keys and values in place (quantized for int8 caches, cast otherwise).

    Args:
        k, v: [N, Hkv, D]; slot_mapping: [N] int64, slot = block_id * B + offset.
    """
    write_kv_fused(k_cache, k_scale, k, slot_mapping)  # any head count works: here Hkv heads of one kind
    write_kv_fused(v_cache, v_scale, v, slot_mapping)


def write_kv_fused(kv_cache: Tensor, kv_scale: Tensor | None, kv: Tensor, slot_mapping: Tensor) -> None:
    """Store new tokens' keys and values held side by side, with one quantization and one scatter.

    Args:
        kv_cache: [num_blocks, B, 2 * Hkv, D] (K heads then V heads); kv_scale: [num_blocks, B, 2 * Hkv] fp32
            for int8, else None; kv: [N, 2 * Hkv, D]; slot_mapping: [N] int64.
    """
    rows = kv_cache.view(-1, kv_cache.shape[-2], kv_cache.shape[-1])  # rows: [num_blocks * B, 2 Hkv, D]
    if kv_cache.dtype == torch.int8:
        assert kv_scale is not None, "int8 cache needs a scale tensor"
        q, s = quantize_kv(kv)
        rows.index_copy_(0, slot_mapping, q)
        kv_scale.view(-1, kv_scale.shape[-1]).index_copy_(0, slot_mapping, s)  # [num_blocks * B, 2 Hkv]
    else:
        rows.index_copy_(0, slot_mapping, kv.to(kv_cache.dtype))


def gather_codes(cache: Tensor, scale: Tensor, block_table: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """One sequence's first `length` tokens of an int8 cache as they are stored: codes [length, Hkv, D] int8 and
    scales [length, Hkv] fp32, each contiguous (gather_kv's arguments)."""
    block_size, hkv, d = cache.shape[1:]
    used = (length + block_size - 1) // block_size
    ids = block_table[:used]
    codes = cache.index_select(0, ids).view(used * block_size, hkv, d)[:length]
    return codes, scale.index_select(0, ids).view(used * block_size, hkv)[:length].contiguous()


def gather_kv(cache: Tensor, scale: Tensor | None, block_table: Tensor, length: int, dtype: torch.dtype) -> Tensor:
    """One sequence's first `length` tokens, contiguous and dequantized.

    Args:
        cache: [num_blocks, B, Hkv, D]; scale: [num_blocks, B, Hkv] fp32 or None; block_table: [>= ceil(length/B)].
    Returns:
        [length, Hkv, D] in dtype.
    """
    if cache.dtype == torch.int8:
        assert scale is not None, "int8 cache needs a scale tensor"
        codes, s = gather_codes(cache, scale, block_table, length)  # codes: [length, Hkv, D], s: [length, Hkv]
        return (codes.float() * s[..., None]).to(dtype)
    block_size, hkv, d = cache.shape[1:]
    used = (length + block_size - 1) // block_size
    return cache.index_select(0, block_table[:used]).view(used * block_size, hkv, d)[:length].to(dtype)
