"""build_linear: a float weight quantized into the class of its runtime format."""
from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

from cpuserve.engine.config import ACTIVATION_FORMATS, GROUP_SIZES, WEIGHT_FORMATS
from cpuserve.engine.layers import native
from cpuserve.engine.layers.linear.act_int8 import W4A8Linear, W8A8Linear
from cpuserve.engine.layers.linear.base import QuantLinear
from cpuserve.engine.layers.linear.coded import (CodedRows, CodedWeight, coded_misfit, int4pack_misfit,
                                                 split_input_order, to_int4pack_linear, to_linear)
from cpuserve.engine.layers.linear.dense import DenseLinear
from cpuserve.engine.layers.linear.int4 import Int4Linear
from cpuserve.engine.layers.linear.int8 import Int8Linear
from cpuserve.engine.layers.linear.permuted import PermutedLinear
from cpuserve.engine.layers.linear.stacked import StackedLinear

_CLASSES = {"int4": Int4Linear, "int8": Int8Linear, "bf16": DenseLinear, "fp32": DenseLinear}
_INT8_ACT_CLASSES = {"int4": W4A8Linear, "int8": W8A8Linear}  # activations="int8" ("int8-token": int8 only)
INT8_ACTIVATIONS = ("int8", "int8-token")
assert tuple(_CLASSES) == WEIGHT_FORMATS, "every weight format needs a class"
log = logging.getLogger(__name__)


def build_linear(weight: Tensor | CodedWeight | CodedRows, bias: Tensor | None, fmt: str, group_size: int = 32,
                 use_fallback: bool = False, activations: str = "bf16") -> QuantLinear:
    """Quantize a float weight into the runtime format, or keep a file's codes.

    Args:
        weight: [N (out_features), K (in_features)] float, or a CodedWeight (a GGUF's block-quantized tensor). Its
            codes are kept as they are (group_size is then the file's) when fmt is int4 / int8 and activations
            int8 on the VNNI kernels: 4-bit codes as int4 if fmt is int4, wider ones as int8. Else it is
            dequantized and quantized like a float weight. CodedRows (a fused weight whose row blocks differ in
            storage) keep each block's codes in a StackedLinear where every block's would be kept, else merge.
        bias: [N] or None.
        fmt: one of WEIGHT_FORMATS.
        group_size: int4 group along K, one of GROUP_SIZES (validated for every fmt).
        use_fallback: force the plain-torch path even when the fast kernel fits (tests, debugging).
        activations: "int8" multiplies int4 / int8 weights with dynamically quantized int8 activations (act_int8.py,
            VNNI) where the kernels are built and the shape fits, else bf16 activations; "bf16" always keeps them
            (torch's kernels' exact arithmetic). bf16 / fp32 weights always run dense. "int8-token" (fmt int8
            only): one activation scale per token, so the weights must be per channel: a file's codes are
            dequantized and quantized again, as vLLM's W8A8 checkpoint is made from the same file.
            An act-order weight (CodedWeight.perm: a GPTQ checkpoint's g_idx) builds its layer over the columns in
            group order, behind a gather of the inputs into that order (PermutedLinear).
    Raises:
        ValueError: unknown fmt, group_size or activations, int8-token with int4, or a weight that is not 2-D.
    """
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"fmt must be one of {WEIGHT_FORMATS}, got {fmt!r}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if activations not in ACTIVATION_FORMATS:
        raise ValueError(f"activations must be one of {ACTIVATION_FORMATS}, got {activations!r}")
    if activations == "int8-token" and fmt == "int4":
        raise ValueError("activations='int8-token' (a scale per token) needs per-channel weights: fmt='int8', "
                         "got fmt='int4' (int4 weights take activations='int8', in their groups)")
    if len(weight.shape) != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    n = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    weight, perm = split_input_order(weight)
    if perm is not None:  # act-order: the codes' layer over inputs gathered into group order
        return PermutedLinear(build_linear(weight, bias, fmt, group_size, use_fallback, activations), perm)
    with torch.no_grad():
        if isinstance(weight, CodedRows):
            if all(_keeps_codes(p, fmt, use_fallback, activations) for p in weight.parts):
                return _with_bias(StackedLinear([to_linear(p, fmt) for p in weight.parts]), bias)
            weight = weight.merged()
        if isinstance(weight, CodedWeight):
            if _keeps_codes(weight, fmt, use_fallback, activations):
                linear = to_linear(weight, fmt)
                return _with_bias(linear, bias)
            if fmt == "int4" and not use_fallback and not int4pack_misfit(weight):  # bf16 activations, same codes
                return _with_bias(to_int4pack_linear(weight), bias)
            if fmt == "int4" and weight.bits > 4:  # never fewer bits than the file: 5..8-bit codes re-quantize to int8
                fmt = "int8"
            weight = weight.dequantize()
        if _int8_activations(weight, fmt, group_size, use_fallback, activations):
            per_token = {"per_token": True} if activations == "int8-token" else {}
            linear = _INT8_ACT_CLASSES[fmt].from_float(weight.detach(), fmt, group_size, **per_token)
        else:
            linear = _CLASSES[fmt].from_float(weight.detach(), fmt, group_size, use_fallback)
        return _with_bias(linear, bias)


def _with_bias(linear: QuantLinear, bias: Tensor | None) -> QuantLinear:
    if bias is not None:
        linear.bias = bias.detach().to(linear.act_dtype).contiguous()
    return linear


def _keeps_codes(weight: CodedWeight, fmt: str, use_fallback: bool, activations: str) -> bool:
    if activations != "int8" or fmt not in _INT8_ACT_CLASSES or use_fallback:
        return False
    if not native.vnni_gemm_enabled():
        _warn_no_vnni()
        return False
    return not coded_misfit(weight)


def _int8_activations(weight: Tensor, fmt: str, group_size: int, use_fallback: bool, activations: str) -> bool:
    if activations not in INT8_ACTIVATIONS or fmt not in _INT8_ACT_CLASSES or use_fallback:
        return False
    if not native.vnni_gemm_enabled():
        _warn_no_vnni()
        return False
    return not _INT8_ACT_CLASSES[fmt].misfit(*weight.shape, group_size, activations == "int8-token")  # else bf16 activations (they fit more)


@functools.lru_cache(maxsize=1)
def _warn_no_vnni() -> None:
    log.warning("activations=int8 needs the int8 dot-product kernels (engine/csrc/vnni_gemm.cpp, avx2_gemm.h), "
                "which are not loaded here (CPUSERVE_KERNELS=torch, or a CPU without AVX2): using bf16 activations")


def check_token_scales(layer: QuantLinear, arch: str, name: str, activations: str) -> QuantLinear:
    """activations "int8-token" is one scheme for the whole model (vLLM's W8A8): a layer whose shape the per-token
    kernel cannot take is refused by name rather than run in another scheme. Where the CPU lacks the VNNI kernels every
    layer falls back to bf16 activations with a warning (build_linear), as the default int8 scheme does there."""
    if activations != "int8-token" or not native.vnni_gemm_enabled():
        return layer
    if isinstance(layer, W8A8Linear) and layer.act_group == layer.in_features:
        return layer
    k, n = layer.in_features, layer.out_features
    why = W8A8Linear.misfit(n, k, k, per_token=True) or f"it took {type(layer).__name__}"
    raise ValueError(f"activations='int8-token' cannot run this {arch} model: {name} [N={n}, K={k}]: {why} "
                     f"(the per-token int8 kernel's steps); use activations='int8' (one scale per 32 inputs)")
