"""int4 weights: group-wise asymmetric round-to-nearest, in torch's int4pack layout.

Our C++ GEMM (engine/csrc/int4_gemm.cpp, with out=) reads torch's layout and is bit-identical to torch's private
CPU kernel, wrapped here and nowhere else (torch is pinned), which runs where ours is not built:

    aten._weight_int4pack_mm_for_cpu(x_bf16 [M, K], packed, group_size, scales_and_zeros)
    scales_and_zeros: [K // group_size, N, 2] bf16, [..., 0] = scale, [..., 1] = zero
    the kernel dequantizes each 4-bit code q in [0, 15] as  w = (q - 8) * scale + zero

It takes and returns bf16 activations (with fp32 activations it is slow). Ours against torch's, medians on AMD
EPYC Zen 4, 2 threads (bench/linear.py): up to 16 rows the weights are dequantized in registers
(int4_few_rows.cpp): 0.97-1.0x at 1-4 rows; from 17 rows once per call into an L1 tile instead of once per 4
rows: 1.03-1.09x at 24 rows here, 1.5x at 32 rows on Intel Xeon (Sapphire Rapids).
"""
from __future__ import annotations

import torch
from torch import Tensor

from cpuserve.engine.layers import native
from cpuserve.engine.layers.linear.base import PackedLinear, QuantLinear
from cpuserve.engine.layers.linear.dense import DenseLinear

INT4_N_ALIGN = 16  # _convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"
INNER_K_TILES = 2  # the CPU packing ignores the tiling beyond a divisibility check; 2 is the loosest


def quantize_int4(weight: Tensor, group_size: int, rows_per_pass: int = 2048) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric round-to-nearest along K, one (scale, zero) per group of `group_size` inputs.

    Scale and zero are rounded to bf16 first (the kernel reads bf16) and the codes are computed against the
    rounded values, so the only error beyond scale/2 comes from the clamp at the group's edges.

    Args:
        weight: [N, K] float, K a multiple of group_size.
    Returns:
        codes [N, K] int32 in [0, 15]; scale, zero [N, K // group_size] bf16; w ~= (codes - 8) * scale + zero.
    """
    n, k = weight.shape
    codes = torch.empty(n, k, dtype=torch.int32)
    scale = torch.empty(n, k // group_size, dtype=torch.bfloat16)
    zero = torch.empty_like(scale)
    for start in range(0, n, rows_per_pass):  # rows are independent: bounded fp32 temporaries for any layer size
        end = min(n, start + rows_per_pass)
        wg = weight[start:end].float().reshape(end - start, k // group_size, group_size)  # wg: [rows, G, group]
        lo, hi = wg.amin(-1), wg.amax(-1)
        s = ((hi - lo) / 15).clamp(min=1e-10).to(torch.bfloat16)
        z = (lo + 8 * s.float()).to(torch.bfloat16)  # code 0 maps to lo
        c = torch.round((wg - z.float()[..., None]) / s.float()[..., None]) + 8
        codes[start:end] = c.clamp_(0, 15).reshape(end - start, k)
        scale[start:end], zero[start:end] = s, z
    return codes, scale, zero


def dequantize_int4(codes: Tensor, scale: Tensor, zero: Tensor, group_size: int) -> Tensor:
    """Inverse of quantize_int4 in fp32: [N, K]."""
    n, k = codes.shape
    cg = codes.float().reshape(n, k // group_size, group_size)  # cg: [N, G, group]
    return ((cg - 8) * scale.float()[..., None] + zero.float()[..., None]).reshape(n, k)


class Int4Linear(PackedLinear):
    """Buffers: packed (torch's int4pack of the codes), scales_and_zeros [K // group_size, N, 2] bf16."""

    @classmethod
    def from_float(cls, weight: Tensor, fmt: str, group_size: int, use_fallback: bool = False) -> QuantLinear:
        """Quantize weight [N, K]; a shape the kernel refuses (or use_fallback) gives a DenseLinear fallback."""
        n, k = weight.shape
        pad = -k % group_size
        # Pad K to whole groups by repeating the last column: it leaves every group's min/max unchanged.
        w = torch.cat([weight, weight[:, -1:].expand(n, pad)], 1) if pad else weight
        codes, scale, zero = quantize_int4(w, group_size)
        reason = "forced" if use_fallback else cls.misfit(n, k, group_size)
        if reason:
            return DenseLinear.fallback(dequantize_int4(codes, scale, zero, group_size)[:, :k], fmt, group_size, reason)
        self = cls(k, n, fmt, group_size)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES))
        # scales_and_zeros: [K // gs, N, 2] bf16, the layout the kernel reads (one N-row of pairs per group)
        self.register_buffer("scales_and_zeros", torch.stack([scale, zero], -1).transpose(0, 1).contiguous())
        return self

    @staticmethod
    def misfit(n: int, k: int, group_size: int) -> str:
        """Why the kernel cannot take an [N, K] weight, or "" when it can."""
        if n % INT4_N_ALIGN:
            return f"N={n} is not a multiple of {INT4_N_ALIGN}"
        if k % group_size:
            return f"K={k} is not a multiple of group_size={group_size}"
        return ""

    def _own_kernel(self) -> bool:
        return native.int4_gemm_enabled()

    def _gemm(self, x2: Tensor, own: bool) -> Tensor:
        args = (x2, self.packed, self.group_size, self.scales_and_zeros)
        return torch.ops.cpuserve.int4_gemm(*args) if own else torch.ops.aten._weight_int4pack_mm_for_cpu(*args)

    def _gemm_into(self, x2: Tensor, y: Tensor) -> None:
        torch.ops.cpuserve.int4_gemm.out(x2, self.packed, self.group_size, self.scales_and_zeros, out=y)

    def dequantize(self) -> Tensor:
        # The packed layout is the kernel's private business, so read the codes back through the kernel itself:
        # with unit scales and zero points 0 it returns (q - 8) for an identity input, exactly (small integers).
        n, k, gs = self.out_features, self.in_features, self.group_size
        unit = torch.zeros(k // gs, n, 2, dtype=torch.bfloat16)
        unit[..., 0] = 1
        codes = torch.empty(k, n)
        for start in range(0, k, 256):
            rows = min(256, k - start)
            eye = torch.zeros(rows, k, dtype=torch.bfloat16)
            eye[:, start:start + rows].fill_diagonal_(1)
            codes[start:start + rows] = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, gs, unit).float()
        scale = self.scales_and_zeros[..., 0].float().t()  # scale: [N, K // gs]
        zero = self.scales_and_zeros[..., 1].float().t()
        return dequantize_int4(codes.t() + 8, scale, zero, gs)
