"""A K-quant's sub-scales and sub-mins in 12 bits a group, as the int8 GEMMs read them (vnni_layouts.h supers).

Q2_K, Q4_K and Q5_K give every group (16 or 32 inputs) a sub-scale and a sub-min below 64, which their files pack
into 12 bits. The kernel reads them in the same 12 bits, laid out for its column blocks of 16 outputs:

    scales  uint8 [N/16, G, 16]    bits 0-5 the sub-scale, bits 6-7 the sub-min's low 2 bits
    zoffs   uint8 [N/16, G/2, 16]  the sub-mins' high 4 bits: group 2j's in the low nibble, 2j+1's in the high one

so a Q4_K's 256 weights stream the file's 144 bytes, not 148 with a byte for each.
"""
from __future__ import annotations

import torch
from torch import Tensor


def pack_twelve_bits(sub: Tensor, sub_min: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """Blocked sub-scales and sub-mins [N/16, G, 16] -> (scales, zoffs) above; (None, None) when a value is not in
    0..63 or G is odd."""
    if sub.shape[1] % 2 or not all(0 <= float(t.min()) and float(t.max()) < 64 for t in (sub, sub_min)):
        return None, None
    sub, sub_min = sub.to(torch.uint8), sub_min.to(torch.uint8)
    high = sub_min >> 2
    return sub | ((sub_min & 3) << 6), high[:, 0::2] | (high[:, 1::2] << 4)


def split_twelve_bits(scales: Tensor, zoffs: Tensor) -> tuple[Tensor, Tensor]:
    """(scales, zoffs) above, or the same rows picked out with dim 1 still the groups ([n, G] and [n, G/2]) ->
    (sub-scales, sub-mins) int32, each shaped like scales."""
    scales, zoffs = scales.to(torch.int32), zoffs.to(torch.int32)
    high = torch.stack([zoffs & 15, zoffs >> 4], 2).flatten(1, 2)
    return scales & 63, (high << 2) | (scales >> 6)
