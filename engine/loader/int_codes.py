"""What the GPTQ, AWQ and compressed-tensors loaders share: int32 words of packed codes, and their rule
w = (q - z) * s as a CodedWeight (engine/layers/linear/coded.py: w = code * scale + zoff).

    q  unsigned codes below 2**bits, [N, K]      s  a scale per group, [N, G] (fp16 / bf16 / fp32 in the file)
    z  an integer zero per group, [N, G]         g_idx  optional [K]: the group of each input (act-order)

scale = s and zoff = -z * s hold w exactly in fp32 for fp16 / bf16 scales (z * s has at most 8 + 11 significant
bits, so w = q * s + zoff is exact too); CodedWeight.dequantize gives the file's weights, bit for bit.
"""
from __future__ import annotations

import torch
from torch import Tensor

from cpuserve.engine.layers.linear.coded import CodedWeight


def unpack_words(words: Tensor, bits: int, dim: int, order: list[int] | None = None) -> Tensor:
    """int32 (or int64 holding 32-bit) words, 32 // bits codes each, the first in the lowest bits -> uint8 codes,
    unpacked along dim (0 or 1).

    order: the position (within its word's run of 32 // bits) of the code stored in each field (AWQ's interleave);
    None: field j holds position j. One field at a time, so a layer's temporaries stay at 1.5 bytes a code."""
    per_word = 32 // bits
    w = words if words.dtype == torch.int32 else ((words.to(torch.int64) + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)
    fields = [((w >> (bits * j)) & (2 ** bits - 1)).to(torch.uint8) for j in range(per_word)]  # masked: no sign bits
    if order is not None:
        fields = [fields[order.index(p)] for p in range(per_word)]  # fields[p]: the code at position p
    codes = torch.stack(fields, -1)  # codes: [R, C, per_word]
    if dim == 1:
        return codes.reshape(w.shape[0], -1)  # [R, C * per_word]
    return codes.permute(0, 2, 1).reshape(-1, w.shape[1])  # [R * per_word, C]


def group_order(g_idx: Tensor | None, k: int, group: int, where: str) -> Tensor | None:
    """None when g_idx is absent or the plain k // group; else the permutation that sorts the inputs by group
    (stable), which must leave `group` inputs in every group.

    Raises:
        ValueError: g_idx is not a grouping of K inputs into groups of `group`."""
    plain = torch.arange(k) // group
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64).reshape(-1)
    if g_idx.shape[0] != k:
        raise ValueError(f"{where}: g_idx has {g_idx.shape[0]} entries, expected one per input ({k})")
    if torch.equal(g_idx, plain):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], plain):
        raise ValueError(f"{where}: g_idx does not put exactly {group} inputs in each of {k // group} groups, so its "
                         "groups cannot be made contiguous; such a checkpoint cannot be kept exactly")
    return perm


def coded_weight(q: Tensor, s: Tensor, z: Tensor, group: int, bits: int, source: str, perm: Tensor | None = None
                 ) -> CodedWeight:
    """q [N, K] codes (columns in group order when perm is given), s [N, G] scales, z [N, G] integer zeros."""
    scale = s.to(torch.float32).contiguous()
    zoff = (-(z.to(torch.float64) * scale.to(torch.float64))).to(torch.float32).contiguous()
    return CodedWeight(q.contiguous(), scale, zoff, group, bits, source, perm=perm)


def with_input_order(q: Tensor, perm: Tensor | None) -> Tensor:
    """q [N, K] with its columns in group order (q[:, perm]) where the checkpoint is act-order."""
    return q if perm is None else q.index_select(1, perm)
