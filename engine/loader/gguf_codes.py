"""GGUF block types read as codes + group scales + group offsets (a CodedWeight), without re-quantizing.

Every type the loader keeps stores, per group of 16 or 32 inputs, small unsigned integers q and a rule
w = q * scale + offset. Per type (llama.cpp's ggml-common.h block layouts; QK_K = 256 values per super-block):

    type   bytes/block  code bits  group  scale          offset           stored in the engine as
    Q4_0   18 / 32      4          32     d              -8 d             4-bit codes
    Q4_1   20 / 32      4          32     d              m                4-bit codes
    Q5_0   22 / 32      5          32     d              -16 d            8-bit codes
    Q5_1   24 / 32      5          32     d              m                8-bit codes
    Q8_0   34 / 32      8 (signed) 32     d              -128 d           8-bit codes q + 128
    Q2_K   84 / 256     2          16     d * sc4        -dmin * m4       4-bit codes
    Q3_K   110 / 256    3 (signed) 16     d * (sc6 - 32) -4 * scale       4-bit codes q + 4
    Q4_K   144 / 256    4          32     d * sc6        -dmin * m6       4-bit codes
    Q5_K   176 / 256    5          32     d * sc6        -dmin * m6       8-bit codes
    Q6_K   210 / 256    6 (signed) 16     d * sc8        -32 * scale      8-bit codes q + 32

d, dmin, m are fp16; sc4/m4 4-bit, sc6/m6 6-bit, sc8 int8 sub-block scales: every product is exact in fp32, so the
engine's weights are the file's, bit for bit (tests/engine/test_gguf_codes.py holds them to gguf's own decoder).
The K-quants also keep the factors (SuperScales: d, dmin per super-block of 256, the sub-block integers per group),
which the int8-activation layers store instead of the products: 12 bits per sub-block for a sub-scale and sub-min
(8 for a sub-scale alone, twelve_bits.py) and 2 bytes each for d and dmin per super-block, rather than 2 fp16 per
group (coded.py to_linear).
"""
from __future__ import annotations

import gguf
import numpy as np
import torch

from cpuserve.engine.layers.linear.coded import CodedWeight, SuperScales

QT = gguf.GGMLQuantizationType
DECODE_ROWS = 1024  # rows per pass: the temporaries stay a few MB for any tensor size
_SHIFTS2 = np.array([0, 2, 4, 6], dtype=np.uint8)[None, :, None]  # the four 2-bit fields of a byte


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of every block, as fp32 [B, 1]."""
    return np.ascontiguousarray(b[:, at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[B, n] bytes -> [B, 2n]: the low nibbles first, then the high ones (the order of every 4-bit layout)."""
    return np.concatenate([qs & 15, qs >> 4], 1)


def _bits(mask: np.ndarray, count: int) -> np.ndarray:
    """[B, n] bytes -> [B, count, n]: bit j of byte l at [:, j, l]."""
    shifts = np.arange(count, dtype=np.uint8)[None, :, None]
    return (mask[:, None, :] >> shifts) & 1


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins, each [B, 8] fp32."""
    low_sc, low_m, extra = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([low_sc & 63, (extra & 15) | ((low_sc >> 6) << 4)], 1)
    mn = np.concatenate([low_m & 63, (extra >> 4) | ((low_m >> 6) << 4)], 1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_0(b):
    d = _f16(b, 0)
    return _nibbles(b[:, 2:18]), d, -8 * d


def _q4_1(b):
    return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _q5(b, at_qh, zoff):
    qh = np.ascontiguousarray(b[:, at_qh:at_qh + 4]).view("<u4")  # [B, 1]: bit i of the uint32 = element i
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return _nibbles(b[:, at_qh + 4:at_qh + 20]) | (high << 4), zoff


def _q5_0(b):
    d = _f16(b, 0)
    codes, zoff = _q5(b, 2, -16 * d)
    return codes, d, zoff


def _q5_1(b):
    codes, zoff = _q5(b, 4, _f16(b, 2))
    return codes, _f16(b, 0), zoff


def _q8_0(b):
    d = _f16(b, 0)
    return b[:, 2:34] ^ np.uint8(128), d, -128 * d  # int8 q + 128 as a byte: the sign bit flipped


def _q2_k(b):
    s = b[:, 0:16]
    qs = b[:, 16:80].reshape(-1, 2, 1, 32) >> _SHIFTS2
    d, sub, dmin, sub_min = _f16(b, 80), (s & 15).astype(np.float32), _f16(b, 82), (s >> 4).astype(np.float32)
    return (qs & 3).reshape(-1, 256), d * sub, -dmin * sub_min, (d, sub, dmin, sub_min)


def _q3_k(b):
    low = (b[:, 32:96].reshape(-1, 2, 1, 32) >> _SHIFTS2) & 3
    high = _bits(b[:, 0:32], 8)  # [B, 8, 32]: bit j of hmask[l] belongs to element 32 j + l
    s = b[:, 96:108]
    sc_low = np.concatenate([s[:, 0:8] & 15, s[:, 0:8] >> 4], 1)  # [B, 16]
    sc_high = (s[:, None, 8:12] >> _SHIFTS2[0]) & 3  # [B, 4 shifts, 4 bytes]: scale j's top bits at [j // 4, j % 4]
    d, sub = _f16(b, 108), (sc_low | (sc_high.reshape(-1, 16) << 4)).astype(np.float32) - 32
    scale = d * sub
    return low.reshape(-1, 256) + 4 * high.reshape(-1, 256), scale, -4 * scale, (d, sub, None, None)


def _q4_k(b):
    sc, mn = _scale_min_k4(b[:, 4:16])
    qs = b[:, 16:144].reshape(-1, 4, 32)  # four chunks of 32 bytes: low nibbles, then high, per chunk
    d, dmin = _f16(b, 0), _f16(b, 2)
    return np.concatenate([qs & 15, qs >> 4], 2).reshape(-1, 256), d * sc, -dmin * mn, (d, sc, dmin, mn)


def _q5_k(b):
    sc, mn = _scale_min_k4(b[:, 4:16])
    high = _bits(b[:, 16:48], 8)  # [B, 8, 32]: bit j of qh[l] is the fifth bit of sub-block j's element l
    qs = b[:, 48:176].reshape(-1, 4, 32)
    low = np.concatenate([qs & 15, qs >> 4], 2).reshape(-1, 8, 32)
    d, dmin = _f16(b, 0), _f16(b, 2)
    return (low | (high << 4)).reshape(-1, 256), d * sc, -dmin * mn, (d, sc, dmin, mn)


def _q6_k(b):
    ql = b[:, 0:128].reshape(-1, 2, 64)  # two halves of 128 values: low nibbles of 64 bytes, then high nibbles
    low = np.concatenate([ql & 15, ql >> 4], 2)  # [B, 2, 128]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> _SHIFTS2
    high = (qh & 3).reshape(-1, 2, 128)
    d, sub = _f16(b, 208), b[:, 192:208].view(np.int8).astype(np.float32)
    scale = d * sub
    return (low | (high << 4)).reshape(-1, 256), scale, -32 * scale, (d, sub, None, None)


# type -> (decoder, values per block, group, storage bits)
_DECODERS = {
    QT.Q4_0: (_q4_0, 32, 32, 4), QT.Q4_1: (_q4_1, 32, 32, 4), QT.Q5_0: (_q5_0, 32, 32, 8),
    QT.Q5_1: (_q5_1, 32, 32, 8), QT.Q8_0: (_q8_0, 32, 32, 8), QT.Q2_K: (_q2_k, 256, 16, 4),
    QT.Q3_K: (_q3_k, 256, 16, 4), QT.Q4_K: (_q4_k, 256, 32, 4), QT.Q5_K: (_q5_k, 256, 32, 8),
    QT.Q6_K: (_q6_k, 256, 16, 8),
}
CODED_TYPES = tuple(_DECODERS)


def decode_codes(data: np.ndarray, qtype: QT, shape: tuple[int, int]) -> CodedWeight:
    """A 2-D GGUF tensor's raw blocks (uint8, as GGUFReader maps them) -> CodedWeight [N, K], with the K-quants'
    factors (SuperScales) beside their scales."""
    decoder, per_block, group, bits = _DECODERS[qtype]
    n, k = shape
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks_per_row = k // per_block
    codes = torch.empty(n, k, dtype=torch.uint8)
    terms: list[torch.Tensor | None] = []  # scale, zoff, then the factors d, sub, dmin, sub_min: each [N, K // group]
    packed = data.reshape(n, blocks_per_row * block_bytes)
    for start in range(0, n, DECODE_ROWS):
        rows = slice(start, start + DECODE_ROWS)
        b = np.asarray(packed[rows]).reshape(-1, block_bytes)  # b: [rows * blocks, bytes]
        c, scale, zoff, *factors = decoder(b)
        m = b.shape[0] // blocks_per_row
        codes[rows] = torch.from_numpy(np.ascontiguousarray(c, dtype=np.uint8).reshape(m, k))
        values = [scale, zoff, *(factors[0] if factors else ())]
        if not terms:
            terms = [None if v is None else torch.empty(n, k // group) for v in values]
        for t, v in zip(terms, values):
            if v is not None:  # one value per group: a super-block's d repeated over its groups
                v = np.broadcast_to(v, (b.shape[0], per_block // group)).reshape(m, -1)
                t[rows] = torch.from_numpy(v.astype(np.float32))
    scale, zoff, *factors = terms
    supers = SuperScales(*factors, per_block // group) if factors else None
    return CodedWeight(codes, scale, zoff, group, bits, qtype.name, supers)
