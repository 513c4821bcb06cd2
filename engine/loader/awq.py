"""AWQ checkpoints (quantization_config.quant_method "awq", version "gemm": AutoAWQ, llm-awq's export) as CodedWeight.

A quantized nn.Linear [N out, K in] is three tensors, every one packed along N with AWQ's interleave:

    qweight  int32 [K, N / 8]   word [k, c] holds outputs 8c .. 8c + 7 of input k
    qzeros   int32 [G, N / 8]   the same for the zero of group g
    scales   fp16  [G, N]       G = K / group_size

    field i (bits 4i .. 4i + 3) of a word holds output 8c + AWQ_ORDER[i]:  AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
    w[n, k] = scales[k // group_size, n] * (q[k, n] - z[k // group_size, n])

Only 4-bit codes with zero points exist in this layout (AutoAWQ's WQLinear_GEMM); the GEMV layouts ("gemv",
"gemv_fast") pack otherwise and are refused, as are the Marlin / ExLlama / IPEX repacks some exporters write.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from cpuserve.engine.layers.linear.coded import CodedWeight
from cpuserve.engine.loader.int_codes import coded_weight, unpack_words

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
VERSIONS = ("gemm",)


@dataclass(frozen=True)
class AwqFormat:
    """An AWQ checkpoint's quantization_config, checked."""

    group_size: int
    bits: int = 4
    method: str = "awq"
    tensors: tuple[str, ...] = ("qweight", "qzeros", "scales")
    required: tuple[str, ...] = ("qweight", "qzeros", "scales")

    def is_quantized(self, names: set[str]) -> bool:
        return "qweight" in names

    def decode(self, module: str, t: dict[str, Tensor]) -> CodedWeight:
        """module's tensors (qweight, qzeros, scales) -> CodedWeight [N, K]."""
        where = f"{module} (AWQ)"
        q = unpack_words(t["qweight"], 4, dim=1, order=AWQ_ORDER).t()  # q: [N, K]
        z = unpack_words(t["qzeros"], 4, dim=1, order=AWQ_ORDER)  # z: [G, N]
        n, k = q.shape
        group = self.group_size
        scales = t["scales"]
        if k % group or scales.shape != (k // group, n) or z.shape != (k // group, n):
            raise ValueError(f"{where}: qweight {tuple(t['qweight'].shape)}, qzeros {tuple(t['qzeros'].shape)} and "
                             f"scales {tuple(scales.shape)} do not fit 4-bit codes in groups of {group}")
        return coded_weight(q, scales.t(), z.t(), group, 4, "AWQ-4")


def parse(qc: dict[str, Any], where: str) -> AwqFormat:
    """quantization_config -> AwqFormat. Raises ValueError naming the option that is not supported."""
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{where}: AWQ bits={bits!r} is not supported; supported: [4]")
    group = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"{where}: AWQ group_size={group!r} is not supported; supported: a positive group dividing "
                         "the inputs (32 to 128 usually)")
    version = str(qc.get("version", "gemm")).lower()
    if version not in VERSIONS:
        raise ValueError(f"{where}: AWQ version={version!r} is not supported; supported: {list(VERSIONS)}")
    if qc.get("backend") not in (None, "autoawq", "AUTOAWQ"):
        raise ValueError(f"{where}: AWQ backend={qc['backend']!r} is not supported; supported: 'autoawq' (GEMM)")
    if not qc.get("zero_point", True):
        raise ValueError(f"{where}: AWQ zero_point=false is not supported; supported: zero_point=true (the GEMM "
                         "layout stores zeros)")
    return AwqFormat(group)
