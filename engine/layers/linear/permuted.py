"""An act-order checkpoint's layer: the inputs gathered into its group order, then the codes' own layer.

GPTQ with desc_act (act-order) quantizes a weight's input columns in the order of their activation magnitude, so a
group of `group_size` scales holds scattered inputs (g_idx[k] = the group of input k). Sorting the columns by group
makes every group contiguous again, which is the form the int8-activation and int4 kernels take; the layer then
multiplies inputs gathered into that same order:

    y = W x = W[:, perm] x[perm]        perm: [K], column i of the kept codes multiplies input perm[i]

A gather is exact, so the result is the checkpoint's own weights' product; it costs one copy of the input rows
(K values a token, against the N x K weights the GEMM streams).
"""
from __future__ import annotations

import torch
from torch import Tensor

from cpuserve.engine.layers.linear.base import QuantLinear, RowRanges


class PermutedLinear(QuantLinear):
    """inner: any QuantLinear over the columns in group order (bias included); perm: [K] int64."""

    def __init__(self, inner: QuantLinear, perm: Tensor):
        assert perm.shape == (inner.in_features,), (tuple(perm.shape), inner.in_features)
        super().__init__(inner.in_features, inner.out_features, inner.fmt, inner.group_size)
        self.inner = inner
        self.act_dtype, self.is_fallback = inner.act_dtype, inner.is_fallback
        self.register_buffer("perm", perm.to(torch.int64).contiguous())

    def forward(self, x: Tensor, out: Tensor | None = None, prompt_rows: RowRanges = ()) -> Tensor:
        return self.inner(x.index_select(-1, self.perm), out=out, prompt_rows=prompt_rows)

    def has_prompt_kernel(self) -> bool:
        return self.inner.has_prompt_kernel()

    def has_prompt_silu_kernel(self) -> bool:
        return self.inner.has_prompt_silu_kernel()

    def silu_mul_into(self, x: Tensor, act: Tensor, prompt_rows: RowRanges) -> Tensor:
        return self.inner.silu_mul_into(x.index_select(-1, self.perm), act, prompt_rows)

    def can_write_into(self, rows: int) -> bool:
        return self.inner.can_write_into(rows)

    def dequantize(self) -> Tensor:
        w = self.inner.dequantize()  # w: [N, K], columns in group order
        return torch.empty_like(w).index_copy_(1, self.perm, w)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, input order: act-order (g_idx)"
