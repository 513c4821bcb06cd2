"""compressed-tensors checkpoints (quantization_config.quant_method "compressed-tensors": llm-compressor's W4A16,
W8A16 and W8A8) as CodedWeight.

The config names, per group of modules (config_groups, each with `targets`; `ignore` lists modules left in float),
the weights' integer scheme and the storage format. A quantized nn.Linear [N out, K in] is:

    pack-quantized   weight_packed  int32 [N, K B / 32]  input k in word k // P, bits B (k % P) up (P = 32 // B)
                     weight_shape   int [2]              (N, K)
    int-quantized,   weight         int8 [N, K]          one code a byte (W8A8, or naive storage of any B)
    naive-quantized
    every format     weight_scale   [N, G] (group) or [N, 1] (channel), in the model's dtype
                     weight_zero_point  asymmetric only: pack-quantized packs it along N ([N B / 32, G] int32),
                                        the others store int8 [N, G]
                     weight_g_idx   int [K], older GPTQ act-order ("actorder": "group") exports only

Codes are signed, q in [-2**(B-1), 2**(B-1)); packed words hold q + 2**(B-1). w = (q - zero_point) * scale, so the
kept unsigned codes are u = q + 2**(B-1) with the integer zero z = 2**(B-1) + zero_point.

Input activations: none (W4A16, W8A16), or int8 dynamic per token (W8A8: the engine's int8 activations with one
scale per token and row, exactly that scheme for per-channel weights). Static activation scales, float types (FP8,
NVFP4, MXFP4), block / tensor strategies, sparsity, transforms and KV-cache schemes are refused by name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cpuserve.engine.layers.linear.coded import CodedWeight
from cpuserve.engine.loader.int_codes import coded_weight, group_order, unpack_words, with_input_order

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
BITS = (4, 8)
STRATEGIES = ("group", "channel")
LINEAR_TARGETS = ("Linear",)  # the class name targets every nn.Linear: every projection the engine has


@dataclass(frozen=True)
class Scheme:
    """One config group's weights, checked."""

    bits: int
    group_size: int | None  # None: channel (one group of K)
    symmetric: bool
    fmt: str
    targets: tuple[str, ...]


@dataclass(frozen=True)
class CompressedTensorsFormat:
    schemes: tuple[Scheme, ...]
    ignore: tuple[str, ...] = ()
    method: str = "compressed-tensors"
    tensors: tuple[str, ...] = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx",
                                "weight")
    required: tuple[str, ...] = ("weight_scale",)

    def is_quantized(self, names: set[str]) -> bool:
        return "weight_scale" in names

    def scheme(self, module: str) -> Scheme:
        """The config group whose targets name this module (a regex "re:..." or the class name "Linear")."""
        if _matches(module, self.ignore):
            raise ValueError(f"{module}: quantized tensors on a module quantization_config.ignore lists")
        for s in self.schemes:
            if any(t in LINEAR_TARGETS for t in s.targets) or _matches(module, s.targets):
                return s
        raise ValueError(f"{module}: no config_groups entry targets this module")

    def decode(self, module: str, t: dict[str, Tensor]) -> CodedWeight:
        """module's tensors -> CodedWeight [N, K]."""
        s = self.scheme(module)
        where = f"{module} (compressed-tensors {s.fmt})"
        half = 2 ** (s.bits - 1)
        if s.fmt == "pack-quantized":
            if "weight_packed" not in t:
                raise ValueError(f"{where}: weight_packed is missing")
            n, k = t["weight_packed"].shape[0], t["weight_packed"].shape[1] * 32 // s.bits
            if "weight_shape" in t:
                n, k = (int(v) for v in t["weight_shape"].reshape(-1))
            u = unpack_words(t["weight_packed"], s.bits, dim=1)[:, :k]  # u: [N, K], q + half
        else:
            q = t.get("weight")
            if q is None or q.dtype != torch.int8:
                raise ValueError(f"{where}: weight must be int8 codes, got {None if q is None else q.dtype}")
            n, k = q.shape
            u = (q.to(torch.int16) + half).to(torch.uint8)
        scale = t["weight_scale"].reshape(n, -1)
        group = k // scale.shape[1] if s.group_size is None else s.group_size
        if k % group or scale.shape[1] != k // group:
            raise ValueError(f"{where}: weight_scale {tuple(t['weight_scale'].shape)} does not fit [{n}, {k}] in "
                             f"groups of {group}")
        z = torch.full((n, k // group), half, dtype=torch.int64)
        zp = self._zero_point(t, s, n, where)
        if zp is not None:
            z = z + zp.reshape(n, -1).to(torch.int64)
        perm = group_order(t.get("weight_g_idx"), k, group, where)
        return coded_weight(with_input_order(u, perm), scale, z, group, s.bits, f"CT-int{s.bits}", perm)

    @staticmethod
    def _zero_point(t: dict[str, Tensor], s: Scheme, n: int, where: str) -> Tensor | None:
        zp = t.get("weight_zero_point")
        if zp is None or s.symmetric:
            return None
        if s.fmt == "pack-quantized":  # packed along N, stored + half like the codes
            return unpack_words(zp, s.bits, dim=0)[:n].to(torch.int64) - 2 ** (s.bits - 1)
        if zp.dtype != torch.int8:
            raise ValueError(f"{where}: weight_zero_point must be int8, got {zp.dtype}")
        return zp


def _matches(module: str, targets) -> bool:
    for t in targets:
        if t.startswith("re:") and re.match(t[3:], module):
            return True
        if t == module:
            return True
    return False


def parse(qc: dict[str, Any], where: str) -> CompressedTensorsFormat:
    """quantization_config -> CompressedTensorsFormat. Raises ValueError naming the option that is not supported."""
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"{where}: compressed-tensors quantization_status={status!r} is not supported; supported: "
                         "'compressed'")
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if qc.get(key):
            raise ValueError(f"{where}: compressed-tensors {key} is not supported; supported: none (dense weights, "
                             "no transforms, the engine's own KV cache)")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError(f"{where}: compressed-tensors config_groups is empty; nothing says how weights are stored")
    schemes = tuple(_scheme(name, g, qc.get("format"), f"{where}: config_groups.{name}") for name, g in groups.items())
    return CompressedTensorsFormat(schemes, tuple(qc.get("ignore") or ()))


def _scheme(name: str, g: dict[str, Any], default_fmt: str | None, where: str) -> Scheme:
    fmt = g.get("format") or default_fmt
    if fmt not in FORMATS:
        raise ValueError(f"{where}: format={fmt!r} is not supported; supported: {list(FORMATS)}")
    w = g.get("weights") or {}
    if w.get("type", "int") != "int":
        raise ValueError(f"{where}.weights: type={w.get('type')!r} is not supported; supported: 'int'")
    if w.get("num_bits") not in BITS:
        raise ValueError(f"{where}.weights: num_bits={w.get('num_bits')!r} is not supported; supported: {list(BITS)}")
    if w.get("strategy") not in STRATEGIES:
        raise ValueError(f"{where}.weights: strategy={w.get('strategy')!r} is not supported; supported: "
                         f"{list(STRATEGIES)}")
    if w.get("dynamic"):
        raise ValueError(f"{where}.weights: dynamic={w['dynamic']!r} is not supported; supported: false")
    acts = g.get("input_activations")
    if acts and not (acts.get("type", "int") == "int" and acts.get("num_bits") == 8 and acts.get("dynamic") is True
                     and acts.get("strategy") == "token" and acts.get("symmetric", True)):
        raise ValueError(f"{where}.input_activations: {acts!r} is not supported; supported: none, or int8 symmetric "
                         "dynamic per token (W8A8)")
    if g.get("output_activations"):
        raise ValueError(f"{where}.output_activations is not supported; supported: none")
    group = w.get("group_size") if w["strategy"] == "group" else None
    if w["strategy"] == "group" and (not isinstance(group, int) or group < 1):
        raise ValueError(f"{where}.weights: group_size={group!r} is not supported; supported: a positive group")
    return Scheme(w["num_bits"], group, bool(w.get("symmetric", True)), fmt, tuple(g.get("targets") or ()))
