"""GGUF block types kept as codes + group scales (engine/loader/gguf_codes.py), held to gguf's own decoder.

Blocks are real layouts: gguf's own quantizer where it has one (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), else valid blocks
built byte by byte (random codes and sub-block scales, sane fp16 super-block scales: bench/kquant_recipe.py).
"""
from __future__ import annotations

import gguf
import pytest
import torch
from kquant_factory import GGUF_QUANTIZES, real_blocks

from cpuserve.engine.layers import native
from cpuserve.engine.layers.linear import build_linear
from cpuserve.engine.layers.linear.act_int8 import W4A8Linear, W6A8Linear, W8A8Linear
from cpuserve.engine.layers.linear.coded import concat_rows
from cpuserve.engine.layers.linear.int4 import Int4Linear
from cpuserve.engine.layers.linear.int8 import Int8Linear
from cpuserve.engine.loader.gguf_codes import CODED_TYPES, decode_codes

QT = gguf.GGMLQuantizationType
KQUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
FOUR_BIT = ("Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K")  # codes that fit int4 storage
SIX_BIT = ("Q5_0", "Q5_1", "Q5_K", "Q6_K")  # codes below 64: 6-bit storage in the int8-activation kernel
SYMMETRIC = {"Q4_0": 8, "Q3_K": 4, "Q5_0": 16, "Q6_K": 32, "Q8_0": 128}  # zoff = -z * scale: only z is kept
needs_vnni = pytest.mark.skipif(not native.vnni_gemm_enabled(),
                                reason="the int8-activation kernels are not built on this CPU")


def test_every_block_type_is_covered():
    assert {t.name for t in CODED_TYPES} == set(GGUF_QUANTIZES) | set(KQUANTS)


@pytest.mark.parametrize("qtype", GGUF_QUANTIZES + KQUANTS)
def test_codes_decode_to_ggufs_own_values_bit_for_bit(qtype):
    shape = (48, 512)
    raw = real_blocks(qtype, shape)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, QT[qtype]))
    coded = decode_codes(raw, QT[qtype], shape)
    assert torch.equal(coded.dequantize(), ref)
    assert coded.codes.dtype == torch.uint8 and int(coded.codes.max()) < 2 ** coded.bits
    assert coded.bits == (4 if qtype in FOUR_BIT else 8)
    assert coded.group == (16 if qtype in ("Q2_K", "Q3_K", "Q6_K") else 32)
    assert coded.scale.shape == (48, 512 // coded.group)


def test_q4_k_m_fused_qkv_keeps_both_types_exactly():
    """A Q4_K_M layer's q, k (Q4_K) beside v (Q6_K): each keeps its own codes (CodedRows), the same values; merged
    into one weight (for the paths that take one), 8-bit codes in groups of 16, still the same values."""
    shapes = {"Q4_K": (64, 256), "Q6_K": (32, 256)}
    parts = [("Q4_K", 1), ("Q4_K", 2), ("Q6_K", 3)]
    raws = [(q, real_blocks(q, shapes[q], seed)) for q, seed in parts]
    fused = concat_rows([decode_codes(raw, QT[q], shapes[q]) for q, raw in raws])
    ref = torch.cat([torch.from_numpy(gguf.quants.dequantize(raw, QT[q])) for q, raw in raws])
    assert [(p.group, p.bits, p.source) for p in fused.parts] == [(32, 4, "Q4_K"), (16, 8, "Q6_K")]
    assert torch.equal(fused.dequantize(), ref)
    merged = fused.merged()
    assert (merged.group, merged.bits, merged.source) == (16, 8, "Q4_K+Q6_K")
    assert torch.equal(merged.dequantize(), ref)


def _x(k: int, rows: int = 5) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


@needs_vnni
@pytest.mark.parametrize("qtype", GGUF_QUANTIZES + KQUANTS)
def test_int8_activation_layer_multiplies_the_files_own_weights(qtype):
    shape = (64, 512)
    raw = real_blocks(qtype, shape)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, QT[qtype])).double()
    layer = build_linear(decode_codes(raw, QT[qtype], shape), None, "int4", activations="int8")
    assert isinstance(layer, W4A8Linear if qtype in FOUR_BIT else W6A8Linear if qtype in SIX_BIT else W8A8Linear)
    if qtype in SYMMETRIC:
        assert layer.zoffs.dtype == torch.int32 and int(layer.zoffs[0]) == SYMMETRIC[qtype]
    elif qtype in KQUANTS:  # the sub-mins' high nibbles, two groups a byte (twelve_bits.py)
        assert layer.zoffs.dtype == torch.uint8 and layer.zoffs.shape[1] * 2 == layer.scales.shape[1]
    else:
        assert layer.zoffs.shape == layer.scales.shape
    if qtype in KQUANTS:  # the file's factors: a sub-scale (and sub-min) per sub-block, fp16 d (and dmin) per 256
        assert layer.supers is not None and layer.scales.dtype in (torch.uint8, torch.int8)
    if qtype in ("Q4_0", "Q4_1", "Q8_0") + KQUANTS or layer.scales.dtype == torch.float32:
        # fp16 d and m, a K-quant's factors, or scales kept in fp32: the layer's effective weights are the file's
        torch.testing.assert_close(layer.dequantize().double(), ref, rtol=1e-6, atol=1e-9)
    else:  # scales rounded to fp16 (compact_scales): each weight within 2**-11 of the largest its group can hold
        codes = decode_codes(raw, QT[qtype], shape)
        bound = (codes.scale.abs() * (2 ** codes.bits - 1) + codes.zoff.abs()) * 2.0 ** -11
        moved = (layer.dequantize().double() - ref).abs().reshape(shape[0], -1, codes.group)
        assert (moved <= bound.double()[..., None] * (1 + 1e-6) + 1e-12).all()
    x = _x(shape[1])
    y = layer(x)
    # the kernel against its plain-torch reference (exact integer sums), then against the file's weights in fp64:
    # what remains is the activations' int8 rounding (groups of 16 / 32 inputs) and the bf16 output
    torch.testing.assert_close(y.float(), layer.reference(x).to(torch.bfloat16).float(), rtol=0.01, atol=1e-3)
    assert _rel_err(y, x.double() @ ref.T) < 0.01


@pytest.mark.parametrize("qtype", ("Q4_0", "Q4_1", "Q4_K"))
def test_bf16_activation_path_keeps_4bit_codes_with_bf16_scales(qtype):
    """bf16 activations (torch's int4 layout): the same codes, scale and zero rounded to bf16 (2^-9 relative each)."""
    shape = (64, 512)
    raw = real_blocks(qtype, shape)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, QT[qtype])).double()
    coded = decode_codes(raw, QT[qtype], shape)
    layer = build_linear(coded, None, "int4", activations="bf16")
    assert isinstance(layer, Int4Linear) and layer.group_size == 32
    scale = coded.scale.double().abs().repeat_interleave(32, 1)
    zero = (coded.zoff.double() + 8 * coded.scale.double()).abs().repeat_interleave(32, 1)
    bound = 2 ** -8 * (8 * scale + zero)  # |code - 8| <= 8
    assert ((layer.dequantize().double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("qtype", ("Q5_0", "Q5_K", "Q6_K", "Q8_0"))
def test_bf16_activation_path_never_gives_wider_codes_fewer_bits(qtype):
    """With bf16 activations 5..8-bit codes cannot stay as they are; they are re-quantized to per-channel int8, never
    to int4: within half an int8 step of the file's values."""
    shape = (64, 512)
    raw = real_blocks(qtype, shape)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, QT[qtype])).double()
    layer = build_linear(decode_codes(raw, QT[qtype], shape), None, "int4", activations="bf16")
    assert isinstance(layer, Int8Linear)
    step = ref.abs().amax(1, keepdim=True) / 127
    assert ((layer.dequantize().double() - ref).abs() <= 0.51 * step * (1 + 2 ** -7)).all()


def test_a_ranks_cut_keeps_the_codes_and_refuses_to_split_a_group():
    """Replica groups cut weights by rows and whole groups of columns (sharding.py); zero rows pad the vocabulary."""
    shape = (64, 512)
    coded = decode_codes(real_blocks("Q6_K", shape), QT.Q6_K, shape)
    full = coded.dequantize()
    assert torch.equal(coded.slice_with(lambda t: t[:, 128:384]).dequantize(), full[:, 128:384])
    assert torch.equal(coded.slice_with(lambda t: t[16:48]).dequantize(), full[16:48])
    padded = coded.slice_with(lambda t: torch.cat([t[:8], t.new_zeros(4, t.shape[1])])).dequantize()
    assert torch.equal(padded[:8], full[:8]) and not padded[8:].any()
    with pytest.raises(ValueError, match="splits its groups of 16 columns"):
        coded.slice_with(lambda t: t[:, 8:72])
