"""K-quant scales kept as the file factors them (coded.super_layout; vnni_layouts.h SuperScales): sub-scales and
sub-mins per group, fp16 d and dmin per super-block, multiplied out in the kernel. Held to gguf's own
dequantization, and to the same kernel over the products stored in fp32 (bit for bit)."""
from __future__ import annotations

import gguf
import pytest
import torch
from kquant_factory import real_blocks

from cpuserve.engine.layers import native
from cpuserve.engine.layers.linear import build_linear
from cpuserve.engine.layers.linear.act_int8 import _blocked, _unblocked
from cpuserve.engine.layers.linear.twelve_bits import pack_twelve_bits, split_twelve_bits
from cpuserve.engine.loader.gguf_codes import decode_codes

QT = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(not native.vnni_gemm_enabled(), reason="needs the int8 dot-product kernels")
KQUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SHAPE = (64, 1024)
ROWS = [1, 3, 8, 11, 16, 17, 20, 37]  # decode (products per group) and beyond (products per tile)


def _layer(qtype: str, shape=SHAPE, seed: int = 0):
    raw = real_blocks(qtype, shape, seed)
    coded = decode_codes(raw, QT[qtype], shape)
    return build_linear(coded, None, "int4", activations="int8"), coded, raw


def _x(rows: int, k: int = SHAPE[1]) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[:, 3] *= 30  # an outlier channel
    return x.to(torch.bfloat16)


def _stored(layer):
    """The layer's (scales, zoffs) as fp32 products in the stored form (the symmetric header kept as it is)."""
    scale, zoff = layer.true_terms()
    return scale.contiguous(), layer.zoffs if layer.zoffs.dtype == torch.int32 else zoff.contiguous()


@pytest.mark.parametrize("qtype", KQUANTS)
def test_layer_keeps_the_factors_and_its_weights_are_the_files(qtype):
    layer, coded, raw = _layer(qtype)
    assert layer.supers is not None and layer.supers.dtype == torch.float16
    assert layer.scales.dtype in (torch.uint8, torch.int8)
    assert layer.supers.shape[1] == layer.scales.shape[1] // (16 if coded.group == 16 else 8)  # 256 per super-block
    ref = torch.from_numpy(gguf.quants.dequantize(raw, QT[qtype])).double()
    torch.testing.assert_close(layer.dequantize().double(), ref, rtol=1e-6, atol=1e-9)
    scale, zoff = layer.true_terms()
    assert torch.equal(_unblocked(scale), coded.scale) and torch.equal(_unblocked(zoff), coded.zoff)  # exactly


@pytest.mark.parametrize("qtype", KQUANTS)
def test_kernel_gives_the_bits_of_the_products_stored_in_fp32(qtype):
    """The scales: d * sub multiplied out in the kernel are the very floats stored. Types with sub-mins take their zero
    term as integer sums instead (test_the_sub_mins_zero_term_is_the_references), so here their sub-mins are zero."""
    layer, _, _ = _layer(qtype)
    if layer.zoffs.dtype == torch.uint8:  # sub-mins: their low 2 bits in the scales' bits 6-7, high 4 in zoffs
        layer.scales &= 63
        layer.zoffs.zero_()
        assert not layer.true_terms()[1].any()
    scales, zoffs = _stored(layer)
    for rows in ROWS:
        x = _x(rows)
        stored = torch.ops.cpuserve.vnni_gemm(x, layer.packed, scales, zoffs, layer.bits, layer.act_group)
        assert torch.equal(layer(x), stored), rows


@pytest.mark.parametrize("qtype", ("Q2_K", "Q4_K", "Q5_K"))
def test_the_sub_mins_zero_term_is_the_references(qtype):
    """With sub-mins, the zero term of a super-block is -dmin times an exact integer sum of sub-min x the activations'
    code sum per group (vnni_epilogue.h zero_term), at every row count: decode's factored scales and a tile's copy."""
    layer, _, _ = _layer(qtype)
    assert layer.act_group == 256 and layer.zoffs.dtype == torch.uint8
    scales, zoffs = _stored(layer)
    for rows in ROWS:
        x = _x(rows)
        y, ref = layer(x).float(), layer.reference(x)  # the reference: float64 over exact integer sums
        tol = 2 ** -8 * ref.abs().max().item()  # a few bf16 roundings; a wrong sub-min moves outputs by far more
        torch.testing.assert_close(y, ref, rtol=0, atol=tol)
        # the zero term matters: without it the outputs are far off
        no_mins = torch.ops.cpuserve.vnni_gemm(x, layer.packed, scales, torch.zeros_like(zoffs), layer.bits,
                                               layer.act_group).float()
        assert (no_mins - ref).abs().max() > 20 * tol, rows


@pytest.mark.parametrize("qtype", ("Q4_K", "Q5_K", "Q6_K"))
def test_a_row_does_not_depend_on_the_batch_or_the_threads(qtype):
    layer, _, _ = _layer(qtype)
    x = _x(37)
    batched = layer(x)
    assert torch.equal(torch.cat([layer(x[i:i + 1]) for i in range(37)]), batched)
    assert torch.equal(torch.cat([layer(x[i:i + 9]) for i in range(0, 37, 9)]), batched)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer(x), batched)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype,nbytes", [("Q4_K", 144), ("Q6_K", 210), ("Q5_K", 208), ("Q2_K", 156)])
def test_bytes_per_super_block_row(qtype, nbytes):
    """Per 256 weights of a row: codes, 12 bits per sub-block for a sub-scale and sub-min (8 for a sub-scale alone),
    fp16 d (and dmin). Q4_K and Q6_K: the file's 144 and 210 (160 and 224 with fp16 products per group); Q5_K's
    5-bit codes take 6 bits, Q2_K's 2-bit codes 4."""
    layer, _, _ = _layer(qtype)
    total = sum(b.nbytes for b in (layer.packed, layer.scales, layer.supers))
    total += layer.zoffs.nbytes if layer.zoffs.dtype != torch.int32 else 0
    assert total == SHAPE[0] * SHAPE[1] // 256 * nbytes


def test_rows_of_the_factored_form_are_the_dequantized_rows():
    """The embedding lookup (engine/layers/embedding.py) reads a tied lm_head's factored scales too."""
    for qtype in ("Q4_K", "Q6_K"):
        layer, _, _ = _layer(qtype)
        ids = torch.tensor([0, 5, 15, 16, 17, 63, 40, 5])
        assert torch.equal(layer.rows(ids), layer.dequantize()[ids])


def test_twelve_bits_hold_every_sub_scale_and_sub_min():
    values = torch.arange(64, dtype=torch.float32)
    sub, sub_min = values.repeat_interleave(64), values.repeat(64)  # every pair, 4096 groups of one column block
    blocked = lambda t: t.reshape(1, -1, 1).expand(1, -1, 16)  # noqa: E731
    scales, zoffs = pack_twelve_bits(blocked(sub), blocked(sub_min))
    assert scales.dtype == zoffs.dtype == torch.uint8 and zoffs.shape == (1, 2048, 16)
    got_sub, got_min = split_twelve_bits(scales, zoffs)
    assert torch.equal(got_sub, blocked(sub).int()) and torch.equal(got_min, blocked(sub_min).int())
    assert pack_twelve_bits(blocked(sub + 1), blocked(sub_min)) == (None, None)  # 64 does not fit
    assert pack_twelve_bits(blocked(sub[:3]), blocked(sub_min[:3])) == (None, None)  # an odd number of groups


def test_a_cut_through_a_super_block_falls_back_to_the_products():
    _, coded, _ = _layer("Q4_K")
    whole = coded.slice_with(lambda t: t[8:40, 256:768])  # rows, and two whole super-blocks of columns
    assert whole.supers is not None
    layer = build_linear(whole, None, "int4", activations="int8")
    assert layer.supers is not None and torch.equal(layer.dequantize(), coded.dequantize()[8:40, 256:768])
    split = coded.slice_with(lambda t: t[:, 128:640])  # groups whole, super-blocks cut
    assert split.supers is None
    layer = build_linear(split, None, "int4", activations="int8")
    assert layer.supers is None and layer.scales.dtype in (torch.float16, torch.float32)  # compact_scales' products


def test_a_factor_per_group_gives_the_super_blocks_result():
    """supers with one d, dmin per group (P = 1, a form the loader never makes) take the zero term per group: the
    same outputs as the file's factors, with activation groups of the weights' groups or of a super-block."""
    layer, _, _ = _layer("Q4_K")
    per_group = layer.supers.repeat_interleave(8, dim=1).contiguous()  # [N/16, S, 2, 16]
    for act_group in (32, 256):
        for rows in (3, 20):  # decode's factored scales, a tile's copy
            x = _x(rows)
            call = lambda supers: torch.ops.cpuserve.vnni_gemm(  # noqa: E731
                x, layer.packed, layer.scales, layer.zoffs, layer.bits, act_group, supers).float()
            ref = call(layer.supers)
            torch.testing.assert_close(call(per_group), ref, rtol=0, atol=2 ** -8 * ref.abs().max().item())


def test_kernel_refuses_supers_of_the_wrong_form():
    layer, _, _ = _layer("Q4_K")
    x = _x(2)
    call = lambda scales, zoffs, supers, bits=4: torch.ops.cpuserve.vnni_gemm(  # noqa: E731
        x, layer.packed, scales, zoffs, bits, layer.act_group, supers)
    with pytest.raises(RuntimeError, match="F = 1 \\(symmetric\\) or 2"):
        call(layer.scales, layer.zoffs, layer.supers[:, :, :1].contiguous())
    with pytest.raises(RuntimeError, match="P a power of two"):
        call(layer.scales, layer.zoffs, layer.supers[:, :3].contiguous())
    with pytest.raises(RuntimeError, match="uint8 or int8 sub-scales"):
        call(layer.scales.float(), layer.zoffs, layer.supers)
    with pytest.raises(RuntimeError, match="sub-mins' high nibbles, uint8 \\[N/16, S/2, 16\\]"):
        call(layer.scales, _blocked(torch.zeros(64, 16)), layer.supers)  # fp32
    with pytest.raises(RuntimeError, match="sub-mins' high nibbles, uint8 \\[N/16, S/2, 16\\]"):
        call(layer.scales, torch.zeros_like(layer.scales), layer.supers)  # a byte per group
    with pytest.raises(RuntimeError, match="4- or 6-bit codes"):
        call(layer.scales, layer.zoffs, layer.supers, bits=8)
