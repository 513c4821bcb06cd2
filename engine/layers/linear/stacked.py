"""One fused projection whose row blocks keep different storage: a layer per block, outputs side by side.

A Q4_K_M file's q and k are Q4_K (4-bit codes in groups of 32) and, in some layers, its v is Q6_K (6-bit codes in
groups of 16). One fused layer would hold every row at the widest storage and the finest group (1.5x the bytes of
q / k at decode); here each block keeps its own and the GEMMs write into their columns of one output:

    y [M, N]:  | q, k (W4A8, groups of 32) | v (W6A8, groups of 16) |
                 parts[0] -> y[:, :n0]        parts[1] -> y[:, n0:]

Each part quantizes the activations in its own groups, so y is bit for bit the separate layers' outputs side by
side (tests/engine/test_stacked_linear.py). The fused decode step runs the parts the same way (decode_layers.cpp).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from cpuserve.engine.layers.linear.act_int8 import Int8ActLinear
from cpuserve.engine.layers.linear.base import QuantLinear


class StackedLinear(QuantLinear):
    """parts: Int8ActLinear over the same inputs, without bias; the bias (if any) is this layer's, added once."""

    def __init__(self, parts: list[Int8ActLinear]):
        assert len({p.in_features for p in parts}) == 1, [p.in_features for p in parts]
        first = parts[0]
        super().__init__(first.in_features, sum(p.out_features for p in parts), first.fmt, first.group_size)
        self.parts = nn.ModuleList(parts)

    def columns(self) -> list[tuple[int, int]]:
        """(first column, number of columns) of each part in the output."""
        starts = [0]
        for p in self.parts:
            starts.append(starts[-1] + p.out_features)
        return [(s, p.out_features) for s, p in zip(starts, self.parts)]

    def can_write_into(self, rows: int) -> bool:
        return True  # Int8ActLinear: always our own kernel

    def has_prompt_kernel(self) -> bool:
        return all(p.has_prompt_kernel() for p in self.parts)

    def dequantize(self) -> Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def reference(self, x2: Tensor) -> Tensor:
        return torch.cat([p.reference(x2) for p in self.parts], 1)

    def prompt_reference(self, x2: Tensor) -> Tensor:
        return torch.cat([p.prompt_reference(x2) for p in self.parts], 1)

    def _forward(self, x: Tensor) -> Tensor:
        x2 = self._rows(x)  # x2: [M, K]
        y = torch.empty(x2.shape[0], self.out_features, dtype=self.act_dtype)  # y: [M, N]
        self._forward_into(x2, y)
        return y.view(*x.shape[:-1], self.out_features)  # y: [..., N]

    def _forward_into(self, x2: Tensor, y: Tensor) -> None:
        for part, (start, n) in zip(self.parts, self.columns()):
            part._gemm_into(x2, y[:, start:start + n])  # the kernel writes rows of stride N
        if self.bias is not None:
            y += self.bias

    def _prompt_gemm_into(self, x2: Tensor, y: Tensor) -> None:
        for part, (start, n) in zip(self.parts, self.columns()):
            part._prompt_gemm_into(x2, y[:, start:start + n])  # as _forward_into: rows of stride N

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, parts={[p.out_features for p in self.parts]}"
