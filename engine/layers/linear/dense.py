"""Dense weights: fp32 and bf16, and the fallback of int4 / int8 weights whose shape the kernels do not accept
(int4: N % 16 or K % group_size; int8: K % 16): the same quantized values dequantized once to a bf16 weight."""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from cpuserve.engine.layers.linear.base import QuantLinear

logger = logging.getLogger(__name__)
_logged_fallbacks: set[str] = set()


class DenseLinear(QuantLinear):
    """W kept as an act_dtype tensor [N, K]: F.linear, and torch.mm / addmm for out=."""

    @classmethod
    def from_float(cls, weight: Tensor, fmt: str, group_size: int, use_fallback: bool = False) -> "DenseLinear":
        """fp32 / bf16 (use_fallback changes nothing: F.linear is the plain-torch path)."""
        self = cls(weight.shape[1], weight.shape[0], fmt, group_size)
        self.register_buffer("weight", weight.to(self.act_dtype).contiguous())
        return self

    @classmethod
    def fallback(cls, weight_fp32: Tensor, fmt: str, group_size: int, reason: str) -> "DenseLinear":
        """An int4 / int8 layer on F.linear: weight_fp32 [N, K] holds its dequantized values; reason is "forced"
        (use_fallback) or the shape the kernel refuses, logged once per reason."""
        if reason != "forced":
            _log_fallback_once(f"{fmt} {reason}")
        self = cls.from_float(weight_fp32, fmt, group_size)
        self.is_fallback = True
        return self

    def can_write_into(self, rows: int) -> bool:
        return True

    def dequantize(self) -> Tensor:
        return self.weight.float()

    def _forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def _forward_into(self, x2: Tensor, y: Tensor) -> None:
        w = self.weight.t()  # what F.linear runs on 2-D input, with out=
        torch.mm(x2, w, out=y) if self.bias is None else torch.addmm(self.bias, x2, w, out=y)


def _log_fallback_once(reason: str) -> None:
    if reason not in _logged_fallbacks:
        _logged_fallbacks.add(reason)
        logger.info("QuantLinear fallback (dequantized bf16 weight + F.linear): %s", reason)
