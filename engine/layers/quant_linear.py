"""Weight-only quantized linear layer: int4 (group-wise RTN), int8 (per channel), bf16, fp32.

The fast paths are our own C++ GEMMs (engine/csrc/int4_gemm.cpp, int8_gemm.cpp), which have an out= (a replica
group's shared-memory slot), and torch's private CPU kernels, wrapped here and nowhere else (torch is pinned).
Ours read torch's weight layouts and are bit-identical to torch's kernels, which run where ours are not built:

    int4: aten._weight_int4pack_mm_for_cpu(x_bf16 [M, K], packed, group_size, scales_and_zeros)
          scales_and_zeros: [K // group_size, N, 2] bf16, [..., 0] = scale, [..., 1] = zero
          the kernel dequantizes each 4-bit code q in [0, 15] as  w = (q - 8) * scale + zero
    int8: aten._weight_int8pack_mm(x_bf16 [M, K], w_int8 [N, K], scales [N] bf16) = (x @ w.T) * scales

Both take and return bf16 activations (with fp32 activations they are slow). A weight whose shape the kernels
do not accept (int4: N % 16 or K % group_size; int8: K % 16, which otherwise crashes or returns garbage) runs
on the fallback: the same quantized values dequantized once to a bf16 weight, then F.linear.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from cpuserve.engine.config import GROUP_SIZES
from cpuserve.engine.config import WEIGHT_FORMATS as FORMATS
from cpuserve.engine.layers import native

logger = logging.getLogger(__name__)

INT4_N_ALIGN = 16  # _convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"
INT8_K_ALIGN = 16  # measured: other K crash (K=33, 34, 36) or return garbage (K=8, 40) in torch 2.13
INNER_K_TILES = 2  # the CPU packing ignores the tiling beyond a divisibility check; 2 is the loosest
# Our kernels against torch's, medians on AMD EPYC Zen 4, 2 threads (bench/linear.py):
#   int4: up to 16 rows the weights are dequantized in registers (int4_few_rows.cpp): 0.97-1.0x at 1-4 rows;
#         from 17 rows once per call into an L1 tile instead of once per 4 rows: 1.03-1.09x at 24 rows here,
#         1.5x at 32 rows on Intel Xeon (Sapphire Rapids)
#   int8: 16 columns per task, every row through them while they stay in L1: 0.92-1.0x at 1-4 rows, on the
#         49152x576 lm_head 1.3x at 8 rows and 1.7x at 32
_logged_fallbacks: set[str] = set()


def _log_fallback_once(reason: str) -> None:
    if reason not in _logged_fallbacks:
        _logged_fallbacks.add(reason)
        logger.info("QuantLinear fallback (dequantized bf16 weight + F.linear): %s", reason)


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


class QuantLinear(torch.nn.Module):
    """y = x @ W.T + b with W stored as int4 / int8 / bf16 / fp32. Build with `from_float`."""

    def __init__(self, in_features: int, out_features: int, fmt: str, group_size: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.fmt, self.group_size = fmt, group_size
        self.act_dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
        self.is_fallback = False
        self.register_buffer("bias", None)

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None, fmt: str, group_size: int = 32,
                   use_fallback: bool = False) -> "QuantLinear":
        """Quantize a float weight into the runtime format.

        Args:
            weight: [N (out_features), K (in_features)] float.
            bias: [N] or None.
            fmt: one of FORMATS.
            group_size: int4 group along K, one of GROUP_SIZES (validated for every fmt).
            use_fallback: force the plain-torch path even when the fast kernel fits (tests, debugging).
        Raises:
            ValueError: unknown fmt or group_size, or a weight that is not 2-D.
        """
        if fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
        if group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
        n, k = weight.shape
        if bias is not None and tuple(bias.shape) != (n,):
            raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
        self = cls(k, n, fmt, group_size)
        if bias is not None:
            self.bias = bias.detach().to(self.act_dtype).contiguous()
        with torch.no_grad():
            getattr(self, f"_init_{fmt}")(weight.detach(), use_fallback)
        return self

    def _init_fp32(self, weight: Tensor, use_fallback: bool) -> None:
        self.register_buffer("weight", weight.float().contiguous())

    def _init_bf16(self, weight: Tensor, use_fallback: bool) -> None:
        self.register_buffer("weight", weight.to(torch.bfloat16).contiguous())

    def _init_int8(self, weight: Tensor, use_fallback: bool) -> None:
        q, scale = quantize_int8(weight)
        reason = "forced" if use_fallback else self._int8_misfit()
        if reason:
            self._set_fallback(q.float() * scale.float()[:, None], f"int8 {reason}")
            return
        self.register_buffer("weight_int8", q)
        self.register_buffer("scales", scale)

    def _init_int4(self, weight: Tensor, use_fallback: bool) -> None:
        n, k = weight.shape
        gs = self.group_size
        pad = -k % gs
        # Pad K to whole groups by repeating the last column: it leaves every group's min/max unchanged.
        w = torch.cat([weight, weight[:, -1:].expand(n, pad)], 1) if pad else weight
        codes, scale, zero = quantize_int4(w, gs)
        reason = "forced" if use_fallback else self._int4_misfit()
        if reason:
            self._set_fallback(dequantize_int4(codes, scale, zero, gs)[:, :k], f"int4 {reason}")
            return
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES))
        # scales_and_zeros: [K // gs, N, 2] bf16, the layout the kernel reads (one N-row of pairs per group)
        self.register_buffer("scales_and_zeros", torch.stack([scale, zero], -1).transpose(0, 1).contiguous())

    def _int4_misfit(self) -> str:
        if self.out_features % INT4_N_ALIGN:
            return f"N={self.out_features} is not a multiple of {INT4_N_ALIGN}"
        if self.in_features % self.group_size:
            return f"K={self.in_features} is not a multiple of group_size={self.group_size}"
        return ""

    def _int8_misfit(self) -> str:
        if self.in_features % INT8_K_ALIGN:
            return f"K={self.in_features} is not a multiple of {INT8_K_ALIGN}"
        return ""

    def _set_fallback(self, weight_fp32: Tensor, reason: str) -> None:
        if not reason.endswith("forced"):
            _log_fallback_once(reason)
        self.is_fallback = True
        self.register_buffer("weight", weight_fp32.to(torch.bfloat16).contiguous())

    def forward(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """x [..., K] -> [..., N] in act_dtype (bf16 for int4/int8/bf16, fp32 for fp32).

        out: a contiguous [..., N] act_dtype tensor to write the result into (a replica group's shared-memory slot:
        Communicator.next_buffer); returned. The same bits as without it.
        """
        if x.dtype != self.act_dtype:
            x = x.to(self.act_dtype)
        if out is not None:
            return self._forward_into(x, out)
        if self.fmt in ("fp32", "bf16") or self.is_fallback:
            return F.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # x2: [M, K]
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        own = self._own_kernel()
        if self.fmt == "int4":
            args = (x2, self.packed, self.group_size, self.scales_and_zeros)
            y = torch.ops.cpuserve.int4_gemm(*args) if own else torch.ops.aten._weight_int4pack_mm_for_cpu(*args)
        else:
            args = (x2, self.weight_int8, self.scales)
            y = torch.ops.cpuserve.int8_gemm(*args) if own else torch._weight_int8pack_mm(*args)
        if self.bias is not None:
            y += self.bias
        return y.view(*lead, self.out_features)  # y: [..., N]

    def input_buffer(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor [rows, in_features] to build this layer's next input in (a replica group's sharded layers
        hand out their collective's shared-memory slot instead)."""
        return torch.empty((rows, self.in_features), dtype=dtype)

    def can_write_into(self, rows: int) -> bool:
        """forward(x, out=) of this many rows computes straight into out; else (torch's int4 / int8 kernels, which
        have no out=, where ours are not built) into a new tensor that is then copied. The same at any number of
        rows today; callers ask per size so that a kernel without out= at some sizes could come back."""
        return self.fmt in ("fp32", "bf16") or self.is_fallback or self._own_kernel()

    def _own_kernel(self) -> bool:
        """An int4 / int8 matmul runs our C++ GEMM (which has out=) when it is built and checked, else torch's
        kernel: the same bits."""
        return native.int4_gemm_enabled() if self.fmt == "int4" else native.int8_gemm_enabled()

    def _forward_into(self, x: Tensor, out: Tensor) -> Tensor:
        lead = x.shape[:-1]
        if out.shape != (*lead, self.out_features) or out.dtype != self.act_dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {self.act_dtype} tensor of shape {(*lead, self.out_features)}, "
                             f"got {out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}")
        x2 = x.reshape(-1, self.in_features)  # x2: [M, K]
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        y = out.view(-1, self.out_features)  # y: [M, N], out's memory
        if not self.can_write_into(x2.shape[0]):
            # torch's kernel (ours are not built here): one copy
            y.copy_(self.forward(x2))
        elif self.fmt in ("fp32", "bf16") or self.is_fallback:  # what F.linear runs on 2-D input, with out=
            w = self.weight.t()
            torch.mm(x2, w, out=y) if self.bias is None else torch.addmm(self.bias, x2, w, out=y)
        else:
            if self.fmt == "int4":
                torch.ops.cpuserve.int4_gemm.out(x2, self.packed, self.group_size, self.scales_and_zeros, out=y)
            else:
                torch.ops.cpuserve.int8_gemm.out(x2, self.weight_int8, self.scales, out=y)
            if self.bias is not None:
                y += self.bias
        return out

    def dequantize(self) -> Tensor:
        """The fp32 [N, K] weight this module effectively multiplies by (tests and reference only)."""
        if self.fmt in ("fp32", "bf16") or self.is_fallback:
            return self.weight.float()
        if self.fmt == "int8":
            return self.weight_int8.float() * self.scales.float()[:, None]
        return self._dequantize_int4_packed()

    def _dequantize_int4_packed(self) -> Tensor:
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

    def extra_repr(self) -> str:
        path = "fallback" if self.is_fallback else "fast"
        return f"in={self.in_features}, out={self.out_features}, fmt={self.fmt}, group={self.group_size}, {path}"
