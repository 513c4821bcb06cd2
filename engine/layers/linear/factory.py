"""build_linear: a float weight quantized into the class of its runtime format."""
from __future__ import annotations

import torch
from torch import Tensor

from cpuserve.engine.config import GROUP_SIZES, WEIGHT_FORMATS
from cpuserve.engine.layers.linear.base import QuantLinear
from cpuserve.engine.layers.linear.dense import DenseLinear
from cpuserve.engine.layers.linear.int4 import Int4Linear
from cpuserve.engine.layers.linear.int8 import Int8Linear

_CLASSES = {"int4": Int4Linear, "int8": Int8Linear, "bf16": DenseLinear, "fp32": DenseLinear}
assert tuple(_CLASSES) == WEIGHT_FORMATS, "every weight format needs a class"


def build_linear(weight: Tensor, bias: Tensor | None, fmt: str, group_size: int = 32,
                 use_fallback: bool = False) -> QuantLinear:
    """Quantize a float weight into the runtime format.

    Args:
        weight: [N (out_features), K (in_features)] float.
        bias: [N] or None.
        fmt: one of WEIGHT_FORMATS.
        group_size: int4 group along K, one of GROUP_SIZES (validated for every fmt).
        use_fallback: force the plain-torch path even when the fast kernel fits (tests, debugging).
    Raises:
        ValueError: unknown fmt or group_size, or a weight that is not 2-D.
    """
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"fmt must be one of {WEIGHT_FORMATS}, got {fmt!r}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    n = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    with torch.no_grad():
        linear = _CLASSES[fmt].from_float(weight.detach(), fmt, group_size, use_fallback)
        if bias is not None:
            linear.bias = bias.detach().to(linear.act_dtype).contiguous()
    return linear
