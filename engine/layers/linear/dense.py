"""Dense weights: fp32 and bf16, and the fallback of int4 / int8 weights whose shape the kernels do not accept
(int4: N % 16 or K % group_size; int8: K % 16): the same quantized values dequantized once to a bf16 weight.

Which GEMM a row takes (QuantLinear.forward's prompt_rows name the prompt rows):

    rows               | decode, verification (speculative) | prompt tokens                                  |
    ours built, bf16   | dense_gemm (engine/csrc)           | F.linear (the prompt kernel: prefill's speed)  |
    ours built, fp32   | dense_gemm                         | dense_gemm (faster than torch's fp32 GEMM here) |
    not built          | F.linear                           | F.linear                                       |

torch's F.linear picks its blocking, and so each row's summation order, by the number of rows: a k + 1-row
verification step rounds unlike a one-row decode. dense_gemm's rows are bit-identical whatever the batch, so greedy
speculative output is decoding's; where it is not built, speculation refuses fp32 / bf16 weights
(spec/drafter.py check_rows_verify_exactly). With bf16 weights a prompt row's bits still follow the size of its
range of prompt rows (F.linear: torch's bf16 GEMM, which here rounds a row alike at nearly every size), as every row's
did before; with fp32 weights (torch's fp32 GEMM rounds a row otherwise at almost every size) no row's does.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from cpuserve.engine.layers import native
from cpuserve.engine.layers.linear.base import QuantLinear

logger = logging.getLogger(__name__)
_logged_fallbacks: set[str] = set()


class DenseLinear(QuantLinear):
    """W kept as an act_dtype tensor [N, K]: dense_gemm for rows that are not prompt tokens where it is built, and
    F.linear / torch.mm / addmm for the others (and for all where it is not, or use_torch_gemm is set)."""

    @classmethod
    def from_float(cls, weight: Tensor, fmt: str, group_size: int, use_fallback: bool = False) -> "DenseLinear":
        """fp32 / bf16; use_fallback: F.linear for every row (the plain-torch path)."""
        self = cls(weight.shape[1], weight.shape[0], fmt, group_size)
        self.register_buffer("weight", weight.to(self.act_dtype).contiguous())
        self.use_torch_gemm = use_fallback  # bench/linear.py flips it to time both GEMMs in one process
        return self

    @classmethod
    def fallback(cls, weight_fp32: Tensor, fmt: str, group_size: int, reason: str) -> "DenseLinear":
        """An int4 / int8 layer on a dense weight: weight_fp32 [N, K] holds its dequantized values; reason is "forced"
        (use_fallback) or the shape the kernel refuses, logged once per reason."""
        if reason != "forced":
            _log_fallback_once(f"{fmt} {reason}")
        self = cls.from_float(weight_fp32, fmt, group_size, use_fallback=reason == "forced")
        self.is_fallback = True
        return self

    def can_write_into(self, rows: int) -> bool:
        return True

    def has_prompt_kernel(self) -> bool:
        # bf16: prompt rows keep F.linear (torch's bf16 GEMM is 2x ours at 512 rows); fp32: ours is faster than
        # torch's at every row count measured (bench/linear.py --dense), so every row takes it, prompt rows too
        return self._own_kernel() and self.act_dtype == torch.bfloat16

    def dequantize(self) -> Tensor:
        return self.weight.float()

    def _own_kernel(self) -> bool:
        return not self.use_torch_gemm and native.dense_gemm_enabled()

    def _forward(self, x: Tensor) -> Tensor:
        if not self._own_kernel():
            return F.linear(x, self.weight, self.bias)
        y = torch.ops.cpuserve.dense_gemm(self._rows(x), self.weight, self.bias)  # y: [M, N]
        return y.view(*x.shape[:-1], self.out_features)  # y: [..., N]

    def _forward_into(self, x2: Tensor, y: Tensor) -> None:
        if self._own_kernel():
            torch.ops.cpuserve.dense_gemm.out(x2, self.weight, self.bias, out=y)
        else:
            self._torch_into(x2, y, self.bias)

    def _prompt_gemm_into(self, x2: Tensor, y: Tensor) -> None:
        self._torch_into(x2, y, None)  # the caller adds the bias

    def _torch_into(self, x2: Tensor, y: Tensor, bias: Tensor | None) -> None:
        w = self.weight.t()  # what F.linear runs on 2-D input, with out=
        torch.mm(x2, w, out=y) if bias is None else torch.addmm(bias, x2, w, out=y)


def _log_fallback_once(reason: str) -> None:
    if reason not in _logged_fallbacks:
        _logged_fallbacks.add(reason)
        logger.info("QuantLinear fallback (dequantized bf16 weight, DenseLinear's GEMMs): %s", reason)
