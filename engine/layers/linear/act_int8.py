"""int4 / int8 weights x dynamic int8 activations: VNNI integer dot products (engine/csrc/vnni_gemm.cpp).

Each row (token) of x is quantized on its own, symmetrically, one scale per group of inputs along K:
s = absmax / 127, q = round(x * 127 / absmax). Weights are unsigned codes with w = code * scale + zoff:

    W4A8Linear  quantize_int4's codes 0..15, zoff = zero - 8 * scale rounded to fp16 (moving a weight by at most
                2^-11 of zoff, under 1% of a quantization step), a scale per weight group; activation groups are
                the weight groups (32 by default)
    W6A8Linear  codes 0..63 a file brought (Q6_K, the 5-bit types; engine/layers/linear/coded.py), its groups
                (a K-quant file's weights, 4- or 6-bit: activation groups of a super-block, 256 inputs, over the
                file's groups of 32 or 16: the y below summed per weight group, the activation scale after)
    W8A8Linear  quantize_int8's per-channel weights as codes w + 128, zoff = -128 * scale; activation groups of
                W8A8_ACT_GROUP inputs or, with activations "int8-token", one group of K: a scale per token (or a
                file's 8-bit codes in its groups)

and per activation group g:  y += float(sum code * q) * scale * ax_g + zoff * ax_g * sum q. Where zoff = -z * scale
for one integer z (symmetric codes: Q4_0, Q8_0, Q6_K, quantize_int8's) only z is kept (`zoffs` is two int32: z and
the scales' power-of-two shift, compact_scales) and the kernel computes y += float(sum code * q - z * sum q) * scale
* ax_g: one multiply fewer per group, no zoffs streamed.

Group scales rather than one scale per row: measured by perplexity over 8k tokens on SmolLM2-135M (int4 weights,
fp32 KV), per-row scales cost +3.6% against fp32 and groups of 32 +1.5%; the lm_head alone, per row, was +0.85%.
Per-token scales stay an option for per-channel int8 weights ("int8-token"): the scheme of vLLM's W8A8, whose
epilogue is one multiply a row and column instead of one a group (see engine/csrc/vnni_gemm.cpp).

Integer sums are exact and the kernel's float epilogue runs in the same order for every output element, so a
row's result depends neither on the batch nor on the tiling nor on the threads. The plain-torch reference beside
the kernel (int8_act_reference) computes the same products with exact integer sums; the tests compare the two.
Where the kernel is not built (CPUSERVE_KERNELS=torch, a CPU without AVX-512 VNNI) build_linear keeps bf16
activations instead (int4.py, int8.py).

Prompt rows (QuantLinear.forward's prompt_rows) take another scheme where the CPU has AMX-BF16 (has_prompt_kernel):
the same codes dequantized to bf16 weights (w = code * scale + zoff in fp32, rounded to bf16), bf16 activations, fp32
sums (torch.ops.cpuserve.amx_bf16_gemm; prompt_reference is its plain-torch reference). Every other row (decodes, a
preempted request's generated tokens recomputed) keeps the int8 scheme.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from cpuserve.engine.layers import native
from cpuserve.engine.layers.linear.base import PackedLinear
from cpuserve.engine.layers.linear.int4 import quantize_int4
from cpuserve.engine.layers.linear.int8 import quantize_int8
from cpuserve.engine.layers.linear.twelve_bits import split_twelve_bits

BLOCK_N = 16  # output columns per packed block (one vpdpbusd's 16 int32 lanes)
W8A8_ACT_GROUP = 32


def quantize_rows(x: Tensor, act_group: int) -> tuple[Tensor, Tensor]:
    """Reference of act_quant.h: x [M, K] -> (q [M, K] fp32 holding integers in [-127, 127],
    scale [M, K // act_group] fp32), x ~= q * scale per group."""
    m, k = x.shape
    xg = x.float().reshape(m, k // act_group, act_group)  # xg: [M, A, act_group]
    absmax = xg.abs().amax(-1)
    inv = torch.where(absmax > 0, 127 / absmax, torch.zeros_like(absmax))
    q = torch.round(xg * inv[..., None]).clamp_(-127, 127)
    return q.reshape(m, k), absmax / 127


def int8_act_reference(x: Tensor, codes: Tensor, scale: Tensor, zoff: Tensor, act_group: int) -> Tensor:
    """x [M, K]; codes [N, K] (unsigned); scale, zoff [N, S] with S = 1, K // act_group or a multiple of it (weight
    groups inside each activation group) -> fp32 [M, N]."""
    m, k = x.shape
    n, a = codes.shape[0], k // act_group
    g = max(a, scale.shape[1])  # the groups of the integer sums
    q, ax = quantize_rows(x, act_group)  # ax: [M, A]
    ax = ax.double().repeat_interleave(g // a, 1)  # ax: [M, G], each activation group's scale over its weight groups
    scale, zoff = scale.double().expand(n, g), zoff.double().expand(n, g)
    qg = q.double().reshape(m, g, k // g).transpose(0, 1)  # qg: [G, M, K/G]
    cg = codes.double().reshape(n, g, k // g).permute(1, 2, 0)  # cg: [G, K/G, N]
    acc = torch.bmm(qg, cg)  # acc: [G, M, N], exact integer sums
    axs = ax * qg.sum(-1).t()  # axs: [M, G]
    y = (acc * (ax.t()[:, :, None] * scale.t()[:, None, :])).sum(0)
    return (y + axs @ zoff.t()).float()


PACK_ROWS = 4096  # rows packed at a time (a multiple of BLOCK_N): a vocabulary's temporaries stay tens of MB


def _by_row_blocks(pack):
    """pack applied PACK_ROWS rows at a time into one output: every block of BLOCK_N rows packs on its own, so the
    bytes are pack's, while its temporaries (several copies of the codes: a 151936-row Q6_K output layer's made
    0.7 GB at load) stay those of PACK_ROWS rows."""
    @functools.wraps(pack)
    def packed(codes: Tensor) -> Tensor:
        n = codes.shape[0]
        if n <= PACK_ROWS:
            return pack(codes)
        first = pack(codes[:PACK_ROWS])
        out = first.new_empty((n // BLOCK_N, *first.shape[1:]))  # out: [N/16, ..., 64]
        out[:PACK_ROWS // BLOCK_N] = first
        for start in range(PACK_ROWS, n, PACK_ROWS):
            out[start // BLOCK_N:(start + PACK_ROWS) // BLOCK_N] = pack(codes[start:start + PACK_ROWS])
        return out
    return packed


@_by_row_blocks
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


@_by_row_blocks
def pack_int6(codes: Tensor) -> Tensor:
    """codes [N, K] in [0, 63] -> [N/16, K/16 * 3, 64] uint8: per 16 inputs k0..k0+15, pack_int4 of the codes' low
    nibbles (two rows of 64), then byte 4c + j = the top 2 bits of code(c, k0 + 4 i + j) at bits 2i, i = 0..3."""
    n, k = codes.shape
    c = codes.to(torch.uint8)
    low = pack_int4(c & 15).reshape(n // BLOCK_N, k // 16, 2, 64)
    top = (c >> 4).reshape(n // BLOCK_N, BLOCK_N, k // 16, 4, 4).permute(0, 2, 1, 4, 3)  # [NB, K16, 16, j, i]
    top = top[..., 0] | (top[..., 1] << 2) | (top[..., 2] << 4) | (top[..., 3] << 6)
    return torch.cat([low, top.reshape(n // BLOCK_N, k // 16, 1, 64)], 2).reshape(n // BLOCK_N, -1, 64).contiguous()


def unpack_int6(packed: Tensor) -> Tensor:
    """Inverse of pack_int6: [N, K] int32 codes."""
    nb, rows, _ = packed.shape
    p = packed.reshape(nb, rows // 3, 3, 64)
    low = unpack_int4(p[:, :, :2].reshape(nb, -1, 64))
    t = p[:, :, 2].reshape(nb, rows // 3, BLOCK_N, 4).to(torch.int32)
    top = torch.stack([(t >> (2 * i)) & 3 for i in range(4)], -1)  # top: [NB, K16, 16, j, i]
    return low | (top.permute(0, 2, 1, 4, 3).reshape(nb * BLOCK_N, -1) << 4)


@_by_row_blocks
def pack_int8(codes: Tensor) -> Tensor:
    """codes [N, K] in [0, 255] -> [N/16, K/4, 64] uint8: byte 4c + j = code(c, k0 + j)."""
    n, k = codes.shape
    c = codes.to(torch.uint8).reshape(n // BLOCK_N, BLOCK_N, k // 4, 4).permute(0, 2, 1, 3)  # [NB, K4, 16, 4]
    return c.reshape(n // BLOCK_N, k // 4, 64).contiguous()


def unpack_int8(packed: Tensor) -> Tensor:
    """Inverse of pack_int8: [N, K] int32 codes."""
    nb, k4, _ = packed.shape
    return packed.reshape(nb, k4, BLOCK_N, 4).permute(0, 2, 1, 3).reshape(nb * BLOCK_N, k4 * 4).to(torch.int32)


FP16_NORMAL = (2.0 ** -14, 65504.0)  # fp16's normal range: a value in it rounds within 2**-11 of itself


def zero_code(scale: Tensor, zoff: Tensor, bits: int) -> int | None:
    """z when zoff = -z * scale everywhere, exactly (symmetric codes), z an integer below 2**bits; else None."""
    nonzero = scale != 0
    if not bool(nonzero.any()):
        return None
    z = round(float(-zoff[nonzero][0] / scale[nonzero][0]))
    return z if 0 <= z < 2 ** bits and torch.equal(zoff.float(), -z * scale.float()) else None


def compact_scales(scale: Tensor, zoff: Tensor, exact: bool = True, bits: int | None = None) -> tuple[Tensor, Tensor]:
    """Blocked scales and zoffs in fp16 when fp16 holds them, else in fp32. The kernel reads either. With bits
    given, symmetric codes (zero_code) keep only z: zoffs is then two int32 {z, e}, the scales stored times 2^e so
    that the smallest lies in fp16's normal range (a Q6_K's sub-block scales often lie below it).

    exact: fp16 only when every value converts exactly (a GGUF's fp16 d and m do: Q4_0, Q4_1, Q8_0). Else also when
    every non-zero value lies in fp16's normal range, so that each rounds within 2**-11 of itself and every weight
    code * scale + zoff moves by at most 2**-11 of the largest magnitude its group can hold (a K-quant's scale is
    an fp16 d times an integer sub-scale: 17 significant bits, not fp16's 11; the move is under 2% of a 4-bit
    quantization step).

    Decode streams the codes and these from memory for every token: in fp16, 32 int4 weights are 20 bytes (llama.cpp's
    Q4_1 size) instead of 24."""
    z = zero_code(scale, zoff, bits) if bits else None
    e = _normal_shift(scale) if z is not None else 0
    parts = [_blocked(scale) * 2.0 ** e] if z is not None else [_blocked(scale), _blocked(zoff)]
    if all(torch.equal(t.half().float(), t) for t in parts) or (not exact and all(_fp16_normal(t) for t in parts)):
        parts = [t.half() for t in parts]
    elif z is not None:
        parts, e = [_blocked(scale)], 0  # fp32 needs no shift
    return parts[0], torch.tensor([z, e], dtype=torch.int32) if z is not None else parts[1]


def _normal_shift(scale: Tensor) -> int:
    """The power of two that lifts the smallest non-zero |scale| into fp16's normal range, if the largest then still
    fits (else 0)."""
    mag = scale.abs()[scale != 0]
    if mag.numel() == 0 or float(mag.min()) >= FP16_NORMAL[0]:
        return 0
    e = math.ceil(math.log2(FP16_NORMAL[0] / float(mag.min())))
    return e if 0 < e < 64 and float(mag.max()) * 2.0 ** e <= FP16_NORMAL[1] else 0


def _fp16_normal(t: Tensor) -> bool:
    mag = t.abs()[t != 0]
    return mag.numel() == 0 or bool(mag.min() >= FP16_NORMAL[0] and mag.max() <= FP16_NORMAL[1])


def _blocked(t: Tensor) -> Tensor:
    """[N, G] -> [N/16, G, 16] fp32, the kernel's per-block layout."""
    n, g = t.shape
    return t.float().reshape(n // BLOCK_N, BLOCK_N, g).transpose(1, 2).contiguous()


def _blocked_rows(t: Tensor, blocks: Tensor, cols: Tensor) -> Tensor:
    """Rows (blocks * 16 + cols) of a blocked [N/16, G, 16] tensor -> [n, G]."""
    return t[blocks, :, cols]


def _unblocked(t: Tensor) -> Tensor:
    nb, g, _ = t.shape
    return t.transpose(1, 2).reshape(nb * BLOCK_N, g)


class Int8ActLinear(PackedLinear):
    """Buffers: packed codes (pack_int4 / pack_int6 / pack_int8), scales and zoffs [N/16, S, 16] fp32 or fp16
    (zoffs {z, e} when symmetric), or a K-quant's factored form with supers (coded.super_layout). Built only where
    the kernel is (build_linear checks), so PackedLinear's own-kernel path is the only one."""

    bits: int
    act_group: int

    @classmethod
    def misfit(cls, n: int, k: int, group_size: int, per_token: bool = False) -> str:
        """Why the kernel cannot take an [N, K] weight, or "" when it can (per_token: one activation group of K)."""
        k_align = 16 if per_token else cls.k_align(group_size)
        if n % BLOCK_N:
            return f"N={n} is not a multiple of {BLOCK_N}"
        if k % k_align:
            return f"K={k} is not a multiple of {k_align}"
        return ""

    @staticmethod
    def k_align(group_size: int) -> int:
        raise NotImplementedError

    def codes(self) -> Tensor:
        return {4: unpack_int4, 6: unpack_int6, 8: unpack_int8}[self.bits](self.packed)

    def true_scales(self) -> Tensor:
        """scales [N/16, S, 16] fp32 (without the symmetric form's 2^e)."""
        return self.true_terms()[0]

    def full_zoffs(self) -> Tensor:
        """zoffs [N/16, S, 16] fp32 (from the zero code where the codes are symmetric)."""
        return self.true_terms()[1]

    def true_terms(self, pick=lambda t: t) -> tuple[Tensor, Tensor]:
        """(scale, zoff) in fp32 of the blocked buffers cut by pick (all of them by default; pick keeps dim 1, the
        groups): the symmetric form's 2^e divided out, its zoff made from the zero code, a K-quant's factored form
        (supers: coded.super_layout) multiplied out as the kernel does, exactly."""
        scale = pick(self.scales).float()
        if self.supers is not None:
            per = self.scales.shape[1] // self.supers.shape[1]  # groups per super-block
            factor = lambda f: pick(self.supers[:, :, f]).float().repeat_interleave(per, 1)  # noqa: E731
            if self.zoffs.dtype == torch.int32:
                return factor(0) * scale, -int(self.zoffs[0]) * factor(0) * scale
            sub, sub_min = split_twelve_bits(pick(self.scales), pick(self.zoffs))
            return factor(0) * sub.float(), factor(1) * sub_min.float()
        if self.zoffs.dtype != torch.int32:
            return scale, pick(self.zoffs).float()
        scale = scale * 2.0 ** -int(self.zoffs[1])
        return scale, -int(self.zoffs[0]) * scale

    def dequantize(self) -> Tensor:
        expand = lambda t: _unblocked(t).repeat_interleave(self.in_features // t.shape[1], dim=1)  # noqa: E731
        return self.codes().float() * expand(self.true_scales()) + expand(self.full_zoffs())

    def rows(self, ids: Tensor) -> Tensor:
        """Weight rows ids [n] -> [n, K] fp32, unpacked from their column blocks alone (an embedding lookup over the
        same codes: a tied lm_head's table costs no second copy)."""
        n, k = ids.numel(), self.in_features
        blocks, cols = ids // BLOCK_N, ids % BLOCK_N
        if self.bits == 8:
            codes = self.packed.view(-1, k // 4, BLOCK_N, 4)[blocks, :, cols].reshape(n, k)
        else:
            b = self.packed.view(-1, self.packed.shape[1], BLOCK_N, 4)[blocks, :, cols]  # b: [n, R, 4]
            if self.bits == 6:
                b = b.reshape(n, k // 16, 3, 4)
                top, b = b[:, :, 2:].to(torch.int32), b[:, :, :2].reshape(n, -1, 4)
            codes = torch.stack([b & 0x0F, b >> 4], 2).reshape(n, k).to(torch.int32)  # inputs k0 + j, k0 + 4 + j
            if self.bits == 6:  # top: [n, K/16, 1, 4]: bits 2i of byte j belong to input k0 + 4 i + j
                high = torch.stack([(top >> (2 * i)) & 3 for i in range(4)], 2).reshape(n, k)
                codes = codes | (high << 4)
        group = k // self.scales.shape[1]
        scale, zoff = self.true_terms(lambda t: _blocked_rows(t, blocks, cols))  # only these rows': [n, S]
        return codes.float() * scale.repeat_interleave(group, 1) + zoff.repeat_interleave(group, 1)

    def reference(self, x2: Tensor) -> Tensor:
        return int8_act_reference(x2, self.codes(), _unblocked(self.true_scales()), _unblocked(self.full_zoffs()),
                                  self.act_group)

    def prompt_reference(self, x2: Tensor) -> Tensor:
        """The prompt scheme in plain torch (reference of _prompt_gemm_into): x2 [M, K] bf16 times the weights, each
        rounded to bf16 from its fp32 code * scale + zoff, products (exact in fp32) summed in fp32 -> [M, N] bf16,
        without bias."""
        w = self.dequantize().to(torch.bfloat16)  # w: [N, K]
        return (x2.float() @ w.float().t()).to(torch.bfloat16)

    def has_prompt_kernel(self) -> bool:
        return self.in_features % 32 == 0 and native.amx_bf16_gemm_enabled()  # the kernel's steps: 32 inputs

    def _prompt_gemm_into(self, x2: Tensor, y: Tensor) -> None:
        torch.ops.cpuserve.amx_bf16_gemm.out(x2, self.packed, self.scales, self.zoffs, self.bits, self.act_group,
                                             self.supers, out=y)

    def has_prompt_silu_kernel(self) -> bool:
        return self.bias is None and self.out_features % 32 == 0 and self.has_prompt_kernel()

    def _prompt_silu_into(self, x2: Tensor, act: Tensor) -> None:
        torch.ops.cpuserve.amx_bf16_gemm_silu.out(x2, self.packed, self.scales, self.zoffs, self.bits, self.act_group,
                                                  self.supers, out=act)

    def _own_kernel(self) -> bool:
        return True

    def set_codes(self, packed: Tensor, scales: Tensor, zoffs: Tensor, act_group: int,
                  supers: Tensor | None = None) -> "Int8ActLinear":
        """The layer's buffers (see the class docstring) and its activation group."""
        self.act_group = act_group
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("zoffs", zoffs)
        self.register_buffer("supers", supers)
        return self

    def _gemm(self, x2: Tensor, own: bool) -> Tensor:
        return torch.ops.cpuserve.vnni_gemm(x2, self.packed, self.scales, self.zoffs, self.bits, self.act_group,
                                            self.supers)

    def _gemm_into(self, x2: Tensor, y: Tensor) -> None:
        torch.ops.cpuserve.vnni_gemm.out(x2, self.packed, self.scales, self.zoffs, self.bits, self.act_group,
                                         self.supers, out=y)


class W4A8Linear(Int8ActLinear):
    bits = 4

    @classmethod
    def from_float(cls, weight: Tensor, fmt: str, group_size: int) -> "W4A8Linear":
        n, k = weight.shape
        codes, scale, zero = quantize_int4(weight, group_size)
        scales, zoffs = compact_scales(scale.float(), (zero.float() - 8 * scale.float()).half().float())
        return cls(k, n, fmt, group_size).set_codes(pack_int4(codes), scales, zoffs, group_size)

    @staticmethod
    def k_align(group_size: int) -> int:
        return group_size  # activation groups are the weight groups


class W6A8Linear(Int8ActLinear):
    """Only a file's codes (coded.to_linear): no from_float."""

    bits = 6

    @staticmethod
    def k_align(group_size: int) -> int:
        return group_size


class W8A8Linear(Int8ActLinear):
    bits = 8

    @classmethod
    def from_float(cls, weight: Tensor, fmt: str, group_size: int, per_token: bool = False) -> "W8A8Linear":
        """Per-channel int8 codes; activations in groups of W8A8_ACT_GROUP, or per_token: one scale per row (the
        kernel's dot products then run over all of K before one multiply a row and column: vLLM's W8A8 scheme)."""
        n, k = weight.shape
        q, scale = quantize_int8(weight)
        symmetric = torch.tensor([128, 0], dtype=torch.int32)  # zoff = -128 * scale
        return cls(k, n, fmt, group_size).set_codes(pack_int8(q.to(torch.int32) + 128), _blocked(scale[:, None]),
                                                    symmetric, k if per_token else W8A8_ACT_GROUP)

    @staticmethod
    def k_align(group_size: int) -> int:
        return W8A8_ACT_GROUP

    def has_prompt_kernel(self) -> bool:
        """Per token (act_group = K, vLLM's W8A8 scheme, the throughput mode): prompt rows keep the scheme, since on
        AMX its integer sums stay in the int8 tiles over all of K (vnni_amx_rows.h is_token_form) and run faster than
        the bf16 prompt kernel (at a 3B model's shapes, 512 rows, 2 cores of a Xeon: ~1200-1650 against ~650-850 G
        multiply-adds a second)."""
        return self.act_group != self.in_features and super().has_prompt_kernel()
