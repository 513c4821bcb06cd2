"""int8 weights: symmetric per-output-channel absmax/127.

Our C++ GEMM (engine/csrc/int8_gemm.cpp, with out=) is bit-identical to torch's private CPU kernel, wrapped here
and nowhere else (torch is pinned), which runs where ours is not built:

    aten._weight_int8pack_mm(x_bf16 [M, K], w_int8 [N, K], scales [N] bf16) = (x @ w.T) * scales

It takes and returns bf16 activations (with fp32 activations it is slow). Ours against torch's, medians on AMD
EPYC Zen 4, 2 threads (bench/linear.py): 16 columns per task, every row through them while they stay in L1:
0.92-1.0x at 1-4 rows, on the 49152x576 lm_head 1.3x at 8 rows and 1.7x at 32.
"""
from __future__ import annotations

import torch
from torch import Tensor

from cpuserve.engine.layers import native
from cpuserve.engine.layers.linear.base import PackedLinear, QuantLinear
from cpuserve.engine.layers.linear.dense import DenseLinear

INT8_K_ALIGN = 16  # measured: other K crash (K=33, 34, 36) or return garbage (K=8, 40) in torch 2.13


def quantize_int8(weight: Tensor, rows_per_pass: int = 4096) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel absmax/127. Returns (int8 [N, K], scales [N] bf16).

    Rows are independent, so they are quantized `rows_per_pass` at a time: the fp32 temporaries of a 49152-row
    lm_head would otherwise be the peak of the whole model load (several hundred MB)."""
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=torch.bfloat16)
    for start in range(0, weight.shape[0], rows_per_pass):
        w = weight[start:start + rows_per_pass].float()
        s = (w.abs().amax(-1) / 127).clamp(min=1e-10).to(torch.bfloat16)
        q[start:start + rows_per_pass] = torch.round(w / s.float()[:, None]).clamp_(-127, 127)
        scale[start:start + rows_per_pass] = s
    return q, scale


class Int8Linear(PackedLinear):
    """Buffers: weight_int8 [N, K] int8, scales [N] bf16."""

    @classmethod
    def from_float(cls, weight: Tensor, fmt: str, group_size: int, use_fallback: bool = False) -> QuantLinear:
        """Quantize weight [N, K]; a shape the kernel refuses (or use_fallback) gives a DenseLinear fallback."""
        n, k = weight.shape
        q, scale = quantize_int8(weight)
        reason = "forced" if use_fallback else cls.misfit(n, k)
        if reason:
            return DenseLinear.fallback(q.float() * scale.float()[:, None], fmt, group_size, reason)
        self = cls(k, n, fmt, group_size)
        self.register_buffer("weight_int8", q)
        self.register_buffer("scales", scale)
        return self

    @staticmethod
    def misfit(n: int, k: int) -> str:
        """Why the kernel cannot take an [N, K] weight, or "" when it can."""
        if k % INT8_K_ALIGN:
            return f"K={k} is not a multiple of {INT8_K_ALIGN}"
        return ""

    def _own_kernel(self) -> bool:
        return native.int8_gemm_enabled()

    def _gemm(self, x2: Tensor, own: bool) -> Tensor:
        args = (x2, self.weight_int8, self.scales)
        return torch.ops.cpuserve.int8_gemm(*args) if own else torch._weight_int8pack_mm(*args)

    def _gemm_into(self, x2: Tensor, y: Tensor) -> None:
        torch.ops.cpuserve.int8_gemm.out(x2, self.weight_int8, self.scales, out=y)

    def dequantize(self) -> Tensor:
        return self.weight_int8.float() * self.scales.float()[:, None]
