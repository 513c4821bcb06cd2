"""GPTQ checkpoints (quantization_config.quant_method "gptq": AutoGPTQ, GPTQModel, optimum) as CodedWeight.

A quantized nn.Linear [N out, K in] is four tensors (GPTQModel's and AutoGPTQ's packing; B = bits, P = 32 // B):

    qweight  int32 [K / P, N]   input k of output n in word [k // P, n], bits B (k % P) and up: packed along K
    qzeros   int32 [G, N / P]   zero of group g, output n in word [g, n // P], bits B (n % P): packed along N
    scales   fp16  [G, N]       G = K / group_size (group_size -1: one group of K)
    g_idx    int32 [K]          the group of each input (absent in some files: k // group_size)

    w[n, k] = scales[g, n] * (q[k, n] - z[g, n]),  g = g_idx[k]

checkpoint_format "gptq" (v1, the default and what every exporter writes) stores each word of zeros minus
0x11111111 (one per field: zero - 1, with its borrow into the next field where a zero is 0); "gptq_v2" stores them
as they are. The loader adds the word back modulo 2**32, which undoes both exactly.

desc_act (act-order) checkpoints whose g_idx scatters the groups over the inputs keep their codes with the columns
sorted by group and the sort as the weight's perm (engine/layers/linear/permuted.py); static_groups and plain files
have g_idx = k // group_size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cpuserve.engine.layers.linear.coded import CodedWeight
from cpuserve.engine.loader.int_codes import coded_weight, group_order, unpack_words, with_input_order

BITS = (4, 8)
FORMATS = ("gptq", "gptq_v2")
V1_ZERO_OFFSET = {4: 0x11111111, 8: 0x01010101}  # one in every field


@dataclass(frozen=True)
class GptqFormat:
    """A GPTQ checkpoint's quantization_config, checked."""

    bits: int
    group_size: int  # -1: one group per output row
    v1_zeros: bool
    method: str = "gptq"
    tensors: tuple[str, ...] = ("qweight", "qzeros", "scales", "g_idx")
    required: tuple[str, ...] = ("qweight", "qzeros", "scales")

    def is_quantized(self, names: set[str]) -> bool:
        return "qweight" in names

    def decode(self, module: str, t: dict[str, Tensor]) -> CodedWeight:
        """module's tensors (qweight, qzeros, scales[, g_idx]) -> CodedWeight [N, K]."""
        b, where = self.bits, f"{module} (GPTQ)"
        q = unpack_words(_int32(t["qweight"], where), b, dim=0).t()  # q: [N, K]
        n, k = q.shape
        group = k if self.group_size == -1 else self.group_size
        if k % group:
            raise ValueError(f"{where}: {k} inputs are not a whole number of groups of {group}")
        scales = t["scales"]
        words = _int32(t["qzeros"], where).to(torch.int64)
        if self.v1_zeros:
            words = (words + V1_ZERO_OFFSET[b]) & 0xFFFFFFFF
        z = unpack_words(words, b, dim=1)  # z: [G, N]
        if scales.shape != (k // group, n) or z.shape != (k // group, n):
            raise ValueError(f"{where}: scales {tuple(scales.shape)} and qzeros {tuple(t['qzeros'].shape)} do not fit "
                             f"qweight {tuple(t['qweight'].shape)} with {b}-bit codes in groups of {group}")
        perm = group_order(t.get("g_idx"), k, group, where)
        return coded_weight(with_input_order(q, perm), scales.t(), z.t(), group, b, f"GPTQ-{b}", perm)


def _int32(t: Tensor, where: str) -> Tensor:
    if t.dtype != torch.int32:
        raise ValueError(f"{where}: packed tensors must be int32, got {t.dtype}")
    return t


def parse(qc: dict[str, Any], where: str) -> GptqFormat:
    """quantization_config -> GptqFormat. Raises ValueError naming the option that is not supported."""
    bits = qc.get("bits")
    if bits not in BITS:
        raise ValueError(f"{where}: GPTQ bits={bits!r} is not supported; supported: {list(BITS)}")
    group = qc.get("group_size", 128)
    if not isinstance(group, int) or (group != -1 and group < 1):
        raise ValueError(f"{where}: GPTQ group_size={group!r} is not supported; supported: a positive group "
                         "dividing the inputs (32 to 128 usually), or -1 (one per row)")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if fmt not in FORMATS or qc.get("is_marlin_format"):
        fmt = "marlin" if qc.get("is_marlin_format") else fmt
        raise ValueError(f"{where}: GPTQ checkpoint_format={fmt!r} is not supported; supported: {list(FORMATS)}")
    if qc.get("pack_dtype", "int32") != "int32":
        raise ValueError(f"{where}: GPTQ pack_dtype={qc['pack_dtype']!r} is not supported; supported: 'int32'")
    if qc.get("dynamic"):
        raise ValueError(f"{where}: GPTQ dynamic (per-module bits / group sizes) is not supported; supported: one "
                         "bits and group_size for every module")
    return GptqFormat(bits, group, v1_zeros=fmt == "gptq")
