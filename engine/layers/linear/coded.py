"""A quantized weight kept as a file stored it: unsigned integer codes, one scale and one offset per group along K.

    w[n, k] = codes[n, k] * scale[n, k // group] + zoff[n, k // group]

That is the form of every GGUF block type the loader keeps (engine/loader/gguf_codes.py) and the form the int8-
activation kernels multiply (act_int8.py: unsigned codes, w = code * scale + zoff, one scale per activation group),
so a file's 4-bit codes reach the VNNI kernel unchanged and the engine computes with the file's own weights.
A GPTQ act-order checkpoint's groups are sets of scattered inputs (its g_idx): its codes are kept with their
columns in group order and `perm`, the input each column multiplies (build_linear gathers the inputs so first:
permuted.py).
`to_linear` builds that layer. With bf16 activations, 4-bit codes in groups of 32 keep their codes in torch's int4
layout (`to_int4pack_linear`: scale and zero rounded to bf16, which that kernel reads); anything else dequantizes.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from cpuserve.engine.layers.linear.act_int8 import (BLOCK_N, Int8ActLinear, W4A8Linear, W6A8Linear, W8A8Linear,
                                                     _blocked, compact_scales, pack_int4, pack_int6, pack_int8,
                                                     zero_code)
from cpuserve.engine.layers.linear.int4 import INNER_K_TILES, Int4Linear
from cpuserve.engine.layers.linear.twelve_bits import pack_twelve_bits

DEQUANTIZE_ROWS = 2048  # rows per float64 pass: bounded temporaries for any tensor size


@dataclass
class SuperScales:
    """A K-quant's scales as its file factors them: scale = d * sub and zoff = -dmin * sub_min, with d, dmin fp16
    values per super-block of `groups` groups and sub, sub_min small integers per group (every product exact in
    fp32). Each is [N, K // group] fp32 (d, dmin repeated over their super-block's groups), so any cut or
    rearrangement of the scales applies to them alike. dmin and sub_min are None for symmetric types (Q3_K, Q6_K)."""

    d: Tensor
    sub: Tensor
    dmin: Tensor | None
    sub_min: Tensor | None
    groups: int

    def map(self, fn: Callable[[Tensor], Tensor]) -> "SuperScales":
        each = [None if t is None else fn(t) for t in (self.d, self.sub, self.dmin, self.sub_min)]
        return SuperScales(*each, self.groups)


@dataclass
class CodedWeight:
    """codes [N, K] uint8 below 2**bits; scale, zoff [N, K // group] fp32; source: the file's type (e.g. "Q4_K");
    supers: the K-quants' factors of scale and zoff, or None; perm: None, or [K] int64 with column i of codes
    multiplying input perm[i] (act-order: the weight is dequantize()'s columns, scattered back)."""

    codes: Tensor
    scale: Tensor
    zoff: Tensor
    group: int
    bits: int  # 4 or 8: the narrowest storage that holds every code
    source: str
    supers: SuperScales | None = None
    perm: Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self, exact: bool = True, dtype: torch.dtype = torch.float32) -> Tensor:
        """[N, K] in dtype. exact: each value computed in float64 and rounded once to fp32, as a file's own decoder
        does (a 6-bit code times a 19-bit Q6_K scale can round in fp32); else in fp32 (3x faster: for a bf16
        embedding table, whose own rounding is far coarser)."""
        n, k = self.codes.shape
        work = torch.float64 if exact else torch.float32
        out = torch.empty(n, k, dtype=dtype)
        for start in range(0, n, DEQUANTIZE_ROWS):
            rows = slice(start, start + DEQUANTIZE_ROWS)
            c = self.codes[rows].to(work).reshape(-1, k // self.group, self.group)  # c: [rows, G, group]
            w = c * self.scale[rows].to(work)[..., None] + self.zoff[rows].to(work)[..., None]
            out[rows] = w.reshape(-1, k).float().to(dtype)
        if self.perm is not None:  # back to the inputs' order: column i multiplies input perm[i]
            out = torch.empty_like(out).index_copy_(1, self.perm, out)
        return out

    def in_group_order(self) -> "CodedWeight":
        """The same codes and scales without perm: the layer that multiplies inputs already gathered by perm."""
        return CodedWeight(self.codes, self.scale, self.zoff, self.group, self.bits, self.source, self.supers)

    def map_rows(self, fn: Callable[[Tensor], Tensor]) -> "CodedWeight":
        """The same weight with its rows rearranged by fn (applied to codes, scales and offsets alike)."""
        supers = self.supers.map(fn) if self.supers else None
        return CodedWeight(fn(self.codes), fn(self.scale), fn(self.zoff), self.group, self.bits, self.source, supers,
                           self.perm)

    def slice_with(self, fn: Callable[[Tensor], Tensor]) -> "CodedWeight":
        """The weight cut by fn, a function that cuts an [N, K] tensor (rows, whole groups of columns, zero rows
        appended): codes directly; scales and offsets through their [N, K] expansion, so fn sees one layout.

        Raises:
            ValueError: fn cuts through a group.
        """
        g = self.group
        n, k = self.codes.shape
        if self.perm is not None:
            if fn(torch.arange(k).expand(1, k)).shape[1] != k:  # rows only: the columns and their order stay
                raise ValueError(f"this {self.source} act-order weight (g_idx) cannot be cut along its inputs: its "
                                 "groups are scattered over them")
            return CodedWeight(fn(self.codes).contiguous(), fn(self.scale).contiguous(),
                               fn(self.zoff).contiguous(), g, self.bits, self.source, None, self.perm)
        ids = fn(torch.arange(k // g, dtype=torch.int32).repeat_interleave(g).expand(n, k))[:1]  # group id per column
        if ids.shape[1] % g or not torch.equal(ids.view(-1, g), ids.view(-1, g)[:, :1].expand(-1, g)):
            raise ValueError(f"a cut of this {self.source} weight splits its groups of {g} columns")
        part = lambda t: fn(t.repeat_interleave(g, 1))[:, ::g].contiguous()  # noqa: E731 - [rows, K'] -> [rows, G']
        supers = self.supers.map(part) if self.supers and _keeps_super_blocks(ids, g, self.supers.groups) else None
        return CodedWeight(fn(self.codes).contiguous(), part(self.scale), part(self.zoff), g, self.bits, self.source,
                           supers)

    def regroup(self, group: int) -> "CodedWeight":
        """The same values with a finer group (a divisor of self.group): each scale repeated, exactly (without the
        factors: a finer group is for a weight merged with another type's)."""
        if group == self.group:
            return self
        assert self.group % group == 0, (self.group, group)
        rep = self.group // group
        return CodedWeight(self.codes, self.scale.repeat_interleave(rep, 1), self.zoff.repeat_interleave(rep, 1),
                           group, self.bits, self.source, perm=self.perm)


def _keeps_super_blocks(ids: Tensor, group: int, groups: int) -> bool:
    """ids [1, K'], the source group of each column of a cut: whole super-blocks of `groups` groups, each starting
    at a super-block's first group."""
    size = group * groups
    if ids.shape[1] % size:
        return False
    runs = ids.view(-1, size)
    first = runs[:, :1]
    return bool((first % groups == 0).all() and (runs == first + torch.arange(size) // group).all())


def as_float(weight: Tensor | CodedWeight | CodedRows) -> Tensor:
    return weight.dequantize() if isinstance(weight, (CodedWeight, CodedRows)) else weight


def concat_rows(parts: list[Tensor | CodedWeight]) -> Tensor | CodedWeight | CodedRows:
    """Stack weights along N (a fused qkv or gate/up). Coded parts keep their codes: parts of one storage (the same
    type, group and code bits) as one CodedWeight; parts of different storage as CodedRows, so each keeps its own
    width (a Q4_K_M file's Q4_K q / k beside its Q6_K v: 4-bit codes and 6-bit ones, not all 6-bit in groups of 16).
    A float part among coded ones makes the whole fused weight float."""
    if not all(isinstance(p, CodedWeight) for p in parts):
        return torch.cat([as_float(p) for p in parts])
    runs: list[list[CodedWeight]] = []
    for p in parts:  # consecutive parts of one storage fuse
        if runs and _storage(runs[-1][0]) == _storage(p):
            runs[-1].append(p)
        else:
            runs.append([p])
    fused = [_stack(run) for run in runs]
    return fused[0] if len(fused) == 1 else CodedRows(fused)


@dataclass
class CodedRows:
    """Consecutive row blocks of one weight, each a CodedWeight of its own storage (concat_rows)."""

    parts: list[CodedWeight]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]))

    def dequantize(self) -> Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def merged(self) -> CodedWeight | Tensor:
        """One CodedWeight of the finest group and the widest storage of the parts, exactly (for paths that take
        one weight: torch's int4 layout, re-quantization); float when the groups do not nest."""
        group = min(p.group for p in self.parts)
        if any(p.group % group for p in self.parts):
            return self.dequantize()
        return _stack([p.regroup(group) for p in self.parts])


def split_input_order(weight: Tensor | CodedWeight | CodedRows) -> tuple[Tensor | CodedWeight | CodedRows,
                                                                         Tensor | None]:
    """(the weight with its columns in group order and no perm, perm) for an act-order weight; (weight, None) else."""
    if isinstance(weight, CodedWeight) and weight.perm is not None:
        return weight.in_group_order(), weight.perm
    if isinstance(weight, CodedRows) and any(p.perm is not None for p in weight.parts):
        perm = _common_perm(weight.parts)
        return CodedRows([p.in_group_order() for p in weight.parts]), perm
    return weight, None


def _storage(weight: CodedWeight) -> tuple[str, int, int]:
    return weight.source, weight.group, weight.bits


def _common_perm(parts: list[CodedWeight]) -> Tensor | None:
    """The parts' one input order (act-order: fused parts must share their g_idx order to share their inputs)."""
    perm = parts[0].perm
    if any((p.perm is None) != (perm is None) or (perm is not None and not torch.equal(p.perm, perm)) for p in parts):
        raise ValueError("act-order (g_idx) weights fused into one projection (q, k, v or gate, up) order their "
                         "inputs differently; cpuserve keeps their codes only when the orders are the same")
    return perm


def _stack(parts: list[CodedWeight]) -> CodedWeight:
    """Parts of one group stacked along N, in the widest storage of the parts."""
    sources = "+".join(dict.fromkeys(p.source for p in parts))
    cat = lambda name: torch.cat([getattr(p, name) for p in parts])  # noqa: E731
    supers = [p.supers for p in parts]
    if all(supers) and len({(x.groups, x.dmin is None) for x in supers}) == 1:  # one type's factors
        joined = [None if getattr(supers[0], f) is None else torch.cat([getattr(x, f) for x in supers])
                  for f in ("d", "sub", "dmin", "sub_min")]
        supers = SuperScales(*joined, supers[0].groups)
    else:
        supers = None
    return CodedWeight(cat("codes"), cat("scale"), cat("zoff"), parts[0].group, max(p.bits for p in parts), sources,
                       supers, _common_perm(parts))


def coded_misfit(weight: CodedWeight) -> str:
    """Why the VNNI kernel cannot take the codes as they are, or "" when it can."""
    n, k = weight.shape
    if n % BLOCK_N:
        return f"N={n} is not a multiple of {BLOCK_N}"
    if weight.group % 16 or k % weight.group:
        return f"group={weight.group} is not a multiple of 16 dividing K={k}"
    return ""


def to_linear(weight: CodedWeight, fmt: str) -> Int8ActLinear:
    """The int8-activation layer over the file's own codes, in the narrowest storage that holds them: 4 bits when
    fmt is "int4" and every code fits, 6 bits for codes below 64 in groups of 16 or more (Q6_K, the 5-bit types, a
    fused Q4_K + Q6_K qkv), else 8 (and always 8 when fmt is "int8"). Activation groups are the file's groups,
    except a K-quant's kept factors: one activation scale per super-block of 256 inputs, as llama.cpp quantizes
    activations for these files (its Q8_K), over the file's groups of 32 or 16 (vnni_register_blocks.h block_nested; a
    multiply fewer per weight group). Scales and offsets in fp16 where compact_scales(exact=False) allows, symmetric
    codes keeping only their zero."""
    n, k = weight.shape
    if fmt == "int4" and weight.bits == 4:
        bits, cls, pack = 4, W4A8Linear, pack_int4
    elif fmt == "int4" and weight.group % 16 == 0 and int(weight.codes.max()) < 64:
        bits, cls, pack = 6, W6A8Linear, pack_int6
    else:
        bits, cls, pack = 8, W8A8Linear, pack_int8
    layer = cls(k, n, "int4" if bits == 4 else "int8", weight.group)
    factored = super_layout(weight, bits)
    if factored is not None:  # a K-quant's own factors: exactly the file's scales; activations per super-block
        return layer.set_codes(pack(weight.codes), *factored[:2], weight.group * weight.supers.groups,
                               supers=factored[2])
    # fp16: exactly for Q4_0, Q4_1, Q8_0; rounded within 2**-11 for Q5_x and cut K-quants (act_int8.compact_scales)
    scales, zoffs = compact_scales(weight.scale, weight.zoff, exact=False, bits=bits)
    return layer.set_codes(pack(weight.codes), scales, zoffs, weight.group)


def super_layout(weight: CodedWeight, bits: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """(scales, zoffs, supers) of a K-quant in the kernel's factored form (vnni_layouts.h SuperScales), or None where it
    does not fit (no factors, a cut through a super-block, 8-bit storage): then compact_scales' fp16 products.

        scales  the sub-scales, uint8 (or int8 where negative: Q3_K, Q6_K) [N/16, S, 16]; with sub-mins, each
                byte's bits 6-7 hold its sub-min's low 2 bits
        zoffs   the sub-mins' high 4 bits, uint8 [N/16, S/2, 16], groups 2j and 2j+1 in one byte's low and high
                nibble; or {z, 0} int32 where zoff = -z * scale (Q3_K, Q6_K)
        supers  fp16 [N/16, S/P, F, 16]: d, then -dmin (F = 2; F = 1 without sub-mins), P groups a super-block

    Per weight, Q4_K's 0.5625 bytes and Q6_K's 0.82 are the file's; fp16 products took 0.625 and 0.875."""
    s, n, g = weight.supers, *weight.scale.shape
    if s is None or bits not in (4, 6) or g % s.groups or s.groups & (s.groups - 1):  # the kernel shifts by log2 P
        return None
    firsts = [t[:, ::s.groups] for t in (s.d, -s.dmin if s.dmin is not None else None) if t is not None]
    exact = torch.equal(s.d * s.sub, weight.scale) and all(
        torch.equal(f.half().float(), f) for f in firsts) and torch.equal(firsts[0].repeat_interleave(s.groups, 1), s.d)
    sub = _small_ints(s.sub, signed=True)
    if s.sub_min is None:
        z = zero_code(weight.scale, weight.zoff, bits)
        zoffs = None if z is None else torch.tensor([z, 0], dtype=torch.int32)
    else:
        exact = exact and torch.equal(-(s.dmin * s.sub_min), weight.zoff)
        sub, zoffs = pack_twelve_bits(_blocked(s.sub), _blocked(s.sub_min))
    if not exact or sub is None or zoffs is None:
        return None
    supers = torch.stack([_blocked(f) for f in firsts], 2).half()  # supers: [N/16, S/P, F, 16]
    return sub, zoffs, supers


def _small_ints(t: Tensor, signed: bool) -> Tensor | None:
    """Integer values [N, G] blocked as uint8 when they fit it, else as int8 when signed and they fit that."""
    lo, hi = float(t.min()), float(t.max())
    dtype = torch.uint8 if lo >= 0 and hi < 256 else torch.int8 if signed and lo >= -128 and hi < 128 else None
    return None if dtype is None else _blocked(t).to(dtype)


def int4pack_misfit(weight: CodedWeight) -> str:
    """Why torch's int4 layout cannot hold the codes as they are, or "" when it can."""
    if weight.bits != 4 or weight.group < 32:
        return f"{weight.bits}-bit codes in groups of {weight.group} (it takes 4-bit codes in groups of >= 32)"
    return Int4Linear.misfit(*weight.shape, weight.group)


def to_int4pack_linear(weight: CodedWeight) -> Int4Linear:
    """bf16 activations over the file's 4-bit codes: w = (code - 8) * scale + zero, scale and zero in bf16."""
    n, k = weight.shape
    layer = Int4Linear(k, n, "int4", weight.group)
    scale = weight.scale.to(torch.bfloat16)
    zero = (weight.zoff.double() + 8 * weight.scale.double()).to(torch.bfloat16)
    codes = weight.codes.to(torch.int32)
    layer.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES))
    layer.register_buffer("scales_and_zeros", torch.stack([scale, zero], -1).transpose(0, 1).contiguous())
    return layer
