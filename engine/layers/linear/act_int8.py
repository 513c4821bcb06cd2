"""int4 / int8 weights x dynamic int8 activations: VNNI integer dot products (engine/csrc/vnni_gemm.cpp).

Each row (token) of x is quantized on its own, symmetrically: one scale per `act_group` inputs, s = absmax / 127,
q = round(x * 127 / absmax). Integer sums are exact and the kernel's float epilogue runs in the same order for
every output element, so a row's result depends neither on the batch nor on the tiling nor on the threads.

    W4A8Linear  int4 codes (quantize_int4's, group-wise asymmetric): per weight group g,
                y += float(sum code * q) * scale * ax + (zero - 8 * scale) * ax * sum q
    W8A8Linear  int8 per-channel weights (quantize_int8's), one activation scale per row:
                y = float(sum w * q) * scale * ax

The plain-torch references beside them (w4a8_reference, w8a8_reference) compute the same products with exact
integer sums; the tests compare the kernels with them. Where the kernels are not built (CPUSERVE_KERNELS=torch, a
CPU without AVX-512 VNNI) build_linear keeps bf16 activations instead (int4.py, int8.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

from cpuserve.engine.layers import native
from cpuserve.engine.layers.linear.base import QuantLinear
from cpuserve.engine.layers.linear.int4 import quantize_int4
from cpuserve.engine.layers.linear.int8 import quantize_int8

BLOCK_N = 16  # output columns per packed block (one vpdpbusd's 16 int32 lanes)
# Activation scales per row for int8 weights (the whole dot product stays integer), per weight group for int4:
# measured on SmolLM2 (docs/engine.md), per-row scales for int4 layers cost perplexity for no speed.
W4A8_ACT_GROUP = "group"


def quantize_rows(x: Tensor, act_group: int) -> tuple[Tensor, Tensor]:
    """Reference of act_quant.h: x [M, K] -> (q [M, K] fp32 holding integers in [-127, 127],
    scale [M, K // act_group] fp32), x ~= q * scale per group."""
    m, k = x.shape
    xg = x.float().reshape(m, k // act_group, act_group)  # xg: [M, A, act_group]
    absmax = xg.abs().amax(-1)
    inv = torch.where(absmax > 0, 127 / absmax, torch.zeros_like(absmax))
    q = torch.round(xg * inv[..., None]).clamp_(-127, 127)
    return q.reshape(m, k), absmax / 127


def w4a8_reference(x: Tensor, codes: Tensor, scale: Tensor, zero: Tensor, group: int, act_group: int) -> Tensor:
    """x [M, K]; codes [N, K] in [0, 15]; scale, zero [N, K // group] -> fp32 [M, N]."""
    m, k = x.shape
    n, g = codes.shape[0], k // group
    q, s = quantize_rows(x, act_group)
    ax = s.repeat_interleave(act_group // group, dim=1)  # ax: [M, G]
    qg = q.reshape(m, g, group).transpose(0, 1)  # qg: [G, M, group]
    cg = codes.float().reshape(n, g, group).permute(1, 2, 0)  # cg: [G, group, N]
    acc = torch.bmm(qg.double(), cg.double())  # acc: [G, M, N], exact integer sums
    zoff = zero.float() - 8 * scale.float()  # [N, G]
    axs = ax * qg.sum(-1).t()  # [M, G]
    y = (acc * (ax.t()[:, :, None] * scale.float().t()[:, None, :])).sum(0)
    return (y + axs @ zoff.t()).float()


def w8a8_reference(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    """x [M, K]; weight [N, K] int8; scale [N] -> fp32 [M, N]."""
    q, ax = quantize_rows(x, x.shape[1])
    acc = q.double() @ weight.double().t()  # exact integer sums
    return (acc * ax.double() * scale.double()).float()


def pack_int4(codes: Tensor) -> Tensor:
    """codes [N, K] in [0, 15] -> [N/16, K/8, 64] uint8: byte 4c + j = code(c, k0 + j) | code(c, k0 + 4 + j) << 4."""
    n, k = codes.shape
    c = codes.to(torch.uint8).reshape(n // BLOCK_N, BLOCK_N, k // 8, 2, 4).permute(0, 2, 1, 3, 4)  # [NB, K8, 16, 2, 4]
    return (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(n // BLOCK_N, k // 8, 64).contiguous()


def unpack_int4(packed: Tensor) -> Tensor:
    """Inverse of pack_int4: [N, K] int32 codes."""
    nb, k8, _ = packed.shape
    b = packed.reshape(nb, k8, BLOCK_N, 4)
    c = torch.stack([b & 0x0F, b >> 4], 3)  # c: [NB, K8, 16, 2, 4]
    return c.permute(0, 2, 1, 3, 4).reshape(nb * BLOCK_N, k8 * 8).to(torch.int32)


def pack_int8(weight: Tensor) -> Tensor:
    """weight [N, K] int8 -> [N/16, K/4, 64] int8: byte 4c + j = w(c, k0 + j)."""
    n, k = weight.shape
    return weight.reshape(n // BLOCK_N, BLOCK_N, k // 4, 4).permute(0, 2, 1, 3).reshape(n // BLOCK_N, k // 4, 64) \
        .contiguous()


def unpack_int8(packed: Tensor) -> Tensor:
    nb, k4, _ = packed.shape
    return packed.reshape(nb, k4, BLOCK_N, 4).permute(0, 2, 1, 3).reshape(nb * BLOCK_N, k4 * 4)


def _blocked(t: Tensor) -> Tensor:
    """[N, G] -> [N/16, G, 16] fp32, the kernel's per-block layout."""
    n, g = t.shape
    return t.float().reshape(n // BLOCK_N, BLOCK_N, g).transpose(1, 2).contiguous()


def _unblocked(t: Tensor) -> Tensor:
    nb, g, _ = t.shape
    return t.transpose(1, 2).reshape(nb * BLOCK_N, g)


class W4A8Linear(QuantLinear):
    """Buffers: packed [N/16, K/8, 64] uint8, scales and zoffs [N/16, K/group, 16] fp32."""

    @classmethod
    def from_float(cls, weight: Tensor, fmt: str, group_size: int) -> "W4A8Linear":
        n, k = weight.shape
        codes, scale, zero = quantize_int4(weight, group_size)
        self = cls(k, n, fmt, group_size)
        self.act_group = k if W4A8_ACT_GROUP == "row" else group_size
        self.register_buffer("packed", pack_int4(codes))
        self.register_buffer("scales", _blocked(scale))
        self.register_buffer("zoffs", _blocked(zero.float() - 8 * scale.float()))
        return self

    @staticmethod
    def misfit(n: int, k: int, group_size: int) -> str:
        if n % BLOCK_N:
            return f"N={n} is not a multiple of {BLOCK_N}"
        if k % group_size:
            return f"K={k} is not a multiple of group_size={group_size}"
        return ""

    def can_write_into(self, rows: int) -> bool:
        return True

    def dequantize(self) -> Tensor:
        codes = unpack_int4(self.packed).float()
        rep = lambda t: _unblocked(t).repeat_interleave(self.group_size, dim=1)  # noqa: E731  [N, K]
        return codes * rep(self.scales) + rep(self.zoffs)

    def reference(self, x2: Tensor) -> Tensor:
        scale = _unblocked(self.scales)
        zero = _unblocked(self.zoffs) + 8 * scale
        return w4a8_reference(x2, unpack_int4(self.packed), scale, zero, self.group_size, self.act_group)

    def _forward(self, x: Tensor) -> Tensor:
        x2 = self._rows(x)
        y = torch.ops.cpuserve.w4a8_gemm(x2, self.packed, self.scales, self.zoffs, self.group_size, self.act_group)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _forward_into(self, x2: Tensor, y: Tensor) -> None:
        torch.ops.cpuserve.w4a8_gemm.out(x2, self.packed, self.scales, self.zoffs, self.group_size, self.act_group,
                                         out=y)
        if self.bias is not None:
            y += self.bias


class W8A8Linear(QuantLinear):
    """Buffers: packed [N/16, K/4, 64] int8, scales [N] fp32, comp [N] int32 = 128 * sum_k w."""

    @classmethod
    def from_float(cls, weight: Tensor, fmt: str, group_size: int) -> "W8A8Linear":
        n, k = weight.shape
        q, scale = quantize_int8(weight)
        self = cls(k, n, fmt, group_size)
        self.register_buffer("packed", pack_int8(q))
        self.register_buffer("scales", scale.float())
        self.register_buffer("comp", 128 * q.sum(1, dtype=torch.int32))
        return self

    @staticmethod
    def misfit(n: int, k: int, group_size: int) -> str:
        if n % BLOCK_N:
            return f"N={n} is not a multiple of {BLOCK_N}"
        if k % 16:
            return f"K={k} is not a multiple of 16"
        return ""

    def can_write_into(self, rows: int) -> bool:
        return True

    def dequantize(self) -> Tensor:
        return unpack_int8(self.packed).float() * self.scales[:, None]

    def reference(self, x2: Tensor) -> Tensor:
        return w8a8_reference(x2, unpack_int8(self.packed), self.scales)

    def _forward(self, x: Tensor) -> Tensor:
        y = torch.ops.cpuserve.w8a8_gemm(self._rows(x), self.packed, self.scales, self.comp)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _forward_into(self, x2: Tensor, y: Tensor) -> None:
        torch.ops.cpuserve.w8a8_gemm.out(x2, self.packed, self.scales, self.comp, out=y)
        if self.bias is not None:
            y += self.bias


def vnni_available() -> bool:
    return native.vnni_gemm_enabled()
