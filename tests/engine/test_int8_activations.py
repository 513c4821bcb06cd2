"""int4 / int8 weights x dynamic int8 activations (engine/csrc/vnni_gemm.cpp): against the plain-torch reference,
against fp32, and independent of the batch, the tiling and the thread count."""
import pytest
import torch
import torch.nn.functional as F

from cpuserve.engine.config import EngineConfig
from cpuserve.engine.layers import native
from cpuserve.engine.layers.linear import build_linear
from cpuserve.engine.layers.linear.act_int8 import (W4A8Linear, W6A8Linear, W8A8Linear, _unblocked, compact_scales,
                                                    int8_act_reference, pack_int4, pack_int6, pack_int8, quantize_rows, unpack_int4,
                                                    unpack_int6, unpack_int8)
from cpuserve.engine.layers.linear.coded import CodedWeight, to_linear
from cpuserve.engine.layers.linear.int4 import dequantize_int4, quantize_int4

pytestmark = pytest.mark.skipif(not native.vnni_gemm_enabled(), reason="needs the int8 dot-product kernels")
# decode (<= 16 rows: 8-row register blocks and every remainder) and beyond (4-row blocks, every remainder)
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 17, 18, 19, 40]


def make_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * 0.05 + torch.randn(n, 1, generator=gen) * 0.02  # zero points matter


def make_x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, 7] *= 20  # an outlier channel, as real hidden states have
    return x.to(torch.bfloat16)


def assert_matches_reference(y: torch.Tensor, ref: torch.Tensor) -> None:
    # The integer sums are exact on both sides; what differs is the kernel's fp32 epilogue order and its bf16
    # output rounding (2^-9 relative), so 2^-7 of the output's magnitude is a few roundings, while a wrong scale,
    # zero point, code layout or row would be off by tens of percent.
    tol = 2 ** -7 * ref.abs().max().item()
    torch.testing.assert_close(y.float(), ref, rtol=0, atol=tol)


@pytest.mark.parametrize("group", [32, 64, 128, 256])
@pytest.mark.parametrize("n,k", [(960, 1536), (576, 512), (80, 256)])  # K: whole groups of 256
def test_w4a8_matches_the_plain_torch_reference(group, n, k):
    m = build_linear(make_weight(n, k), None, "int4", group, activations="int8")
    assert isinstance(m, W4A8Linear)
    for rows in ROWS:
        x = make_x(rows, k)
        assert_matches_reference(m(x), m.reference(x))


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (80, 96), (49152 // 8, 576)])
def test_w8a8_matches_the_plain_torch_reference(n, k):
    m = build_linear(make_weight(n, k), None, "int8", activations="int8")
    assert isinstance(m, W8A8Linear)
    for rows in ROWS:
        x = make_x(rows, k)
        assert_matches_reference(m(x), m.reference(x))


def coded_layer(bits: int, group: int, zero: int | None, n: int = 96, k: int = 512, seed: int = 2):
    """The layer of a file's codes below 2**bits: symmetric (zoff = -zero * scale) or with offsets of their own."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // group, generator=gen) * 0.01 + 1e-3).half().float()
    zoff = -zero * scale if zero is not None else (torch.randn(n, k // group, generator=gen) * 0.01).half().float()
    return to_linear(CodedWeight(codes, scale, zoff, group, 8 if bits == 6 else bits, "test"), "int4")


@pytest.mark.parametrize("bits,group,zero", [(6, 16, 32), (6, 16, None), (6, 32, None), (6, 64, 16), (4, 32, 8),
                                             (4, 16, None), (8, 32, 128)])
def test_file_codes_match_the_plain_torch_reference(bits, group, zero):
    """6-bit storage (Q6_K, the 5-bit types) and symmetric codes (only the zero code kept) at every row count; 7
    column blocks, so the last tile of two has one (beyond 16 rows 6-bit codes are unpacked a tile at a time)."""
    m = coded_layer(bits, group, zero, n=112)
    assert m.bits == bits and isinstance(m, {4: W4A8Linear, 6: W6A8Linear, 8: W8A8Linear}[bits])
    assert (m.zoffs.dtype == torch.int32) == (zero is not None)
    for rows in ROWS:
        x = make_x(rows, 512)
        assert_matches_reference(m(x), m.reference(x))


@pytest.mark.parametrize("bits,group,zero", [(4, 32, None), (4, 32, 8), (6, 16, 32), (6, 32, None), (8, 32, 128)])
def test_rows_are_the_dequantized_weights_rows(bits, group, zero):
    """The embedding lookup over packed codes (engine/layers/embedding.py): each row unpacked from its block alone."""
    m = coded_layer(bits, group, zero)
    ids = torch.tensor([0, 5, 15, 16, 17, 95, 40, 5])
    assert torch.equal(m.rows(ids), m.dequantize()[ids])


def test_symmetric_codes_give_the_stored_offsets_result():
    """The zero code inside the integer sum against the same weights with every zoff stored (the per-group form)."""
    for bits, group, zero in [(6, 16, 32), (8, 32, 128), (4, 32, 8)]:
        m = coded_layer(bits, group, zero)
        x = make_x(19, 512)
        zoffs = m.full_zoffs().to(m.scales.dtype)
        stored = torch.ops.cpuserve.vnni_gemm(x, m.packed, m.scales, zoffs, bits, m.act_group)
        torch.testing.assert_close(m(x).float(), stored.float(), rtol=0, atol=2 ** -7 * stored.abs().max().item())
        # the zero code is read: one more gives the reference of weights one scale lower
        header = m.zoffs + torch.tensor([1, 0], dtype=torch.int32)
        shifted = torch.ops.cpuserve.vnni_gemm(x, m.packed, m.scales, header, bits, m.act_group)
        scale = _unblocked(m.true_scales())
        assert_matches_reference(shifted, int8_act_reference(x, m.codes(), scale, -(zero + 1) * scale, m.act_group))


def test_kernel_refuses_a_zero_code_out_of_range_or_wrong_offsets():
    m = coded_layer(6, 16, 32)
    x = make_x(2, 512)
    for header in ([64, 0], [32, -1], [32]):
        with pytest.raises(RuntimeError, match="two int32 \\{z, e\\}: a zero code z below 2\\*\\*bits"):
            torch.ops.cpuserve.vnni_gemm(x, m.packed, m.scales, torch.tensor(header, dtype=torch.int32), 6, 16)
    with pytest.raises(RuntimeError, match="zoffs must be like scales"):
        torch.ops.cpuserve.vnni_gemm(x, m.packed, m.scales, m.scales[:, :1].contiguous(), 6, 16)
    with pytest.raises(RuntimeError, match="bits must be 4, 6 or 8"):
        torch.ops.cpuserve.vnni_gemm(x, m.packed, m.scales, m.zoffs, 5, 16)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_error_against_fp32_is_within_the_activation_rounding_bound(fmt):
    """Independent of the reference above: F.linear in fp32 over the dequantized weight. Rounding each activation
    to a step of absmax / 127 of its group moves it by at most half a step, so |y - y_fp32| <= 0.5 |W| @ step
    (plus the bf16 output rounding)."""
    w = make_weight(576, 1536)
    m = build_linear(w, None, fmt, 32, activations="int8")
    act_group = m.act_group
    x = make_x(16, 1536).float()
    ref = F.linear(x, m.dequantize())
    step = x.reshape(16, -1, act_group).abs().amax(-1).repeat_interleave(act_group, dim=1) / 127  # [M, K]
    bound = 0.5 * step @ m.dequantize().abs().t() + 2 ** -8 * ref.abs()
    err = (m(x).float() - ref).abs()
    assert (err <= bound * 1.001).all(), (err / bound).max()
    assert (err / bound).max() > 0.01  # the activations are really rounded (not bf16 through another path)


@pytest.mark.parametrize("bits,group,zero,act_group", [(4, 32, None, 256), (4, 32, 8, 64), (6, 16, 32, 256),
                                                        (6, 16, None, 128), (6, 32, None, 512), (6, 64, 16, 256)])
def test_activation_groups_spanning_weight_groups_match_the_reference(bits, group, zero, act_group):
    """A K-quant's activations: one scale per super-block over the weights' groups of 32 or 16 (block_nested), at
    every row count (decode's 8 x 1 blocks, 4 x 2 beyond), the last tile of one column block included; weight
    groups of 64 take the runtime loop."""
    m = coded_layer(bits, group, zero, n=112)
    fine = [m.reference(make_x(rows, 512)) for rows in ROWS]  # activation groups of the weights' groups
    m.act_group = act_group
    for rows, ref_fine in zip(ROWS, fine):
        x = make_x(rows, 512)
        y, ref = m(x).float(), m.reference(x)
        assert_matches_reference(y, ref)
        # the coarser activation scales are really taken: the outlier channel's group rounds its neighbours
        # coarser, which moves the outputs by several times the kernel's own distance from its reference
        assert (y - ref_fine).abs().max() > 4 * (y - ref).abs().max()
    x = make_x(37, 512)
    assert torch.equal(m(x), torch.cat([m(x[i:i + 1]) for i in range(37)]))


@pytest.mark.parametrize("fmt,activations", [("int4", "int8"), ("int8", "int8"), ("int8", "int8-token")])
def test_a_row_does_not_depend_on_the_batch_or_the_threads(fmt, activations):
    m = build_linear(make_weight(576, 576), torch.randn(576), fmt, 32, activations=activations)
    x = make_x(37, 576)
    batched = m(x)
    alone = torch.cat([m(x[i:i + 1]) for i in range(37)])
    assert torch.equal(batched, alone)
    shuffled = torch.randperm(37, generator=torch.Generator().manual_seed(0))
    assert torch.equal(m(x[shuffled]), batched[shuffled])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = m(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, batched)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_out_gives_the_same_bits_in_place(fmt):
    m = build_linear(make_weight(192, 576), torch.randn(192), fmt, 32, activations="int8")
    x = make_x(6, 576)
    out = torch.full((6, 192), float("nan"), dtype=torch.bfloat16)
    assert m(x, out=out) is out and m.can_write_into(6)
    assert torch.equal(out, m(x))


def test_packing_round_trips_and_dequantize_is_the_int4_weight():
    w = make_weight(64, 256)
    codes, scale, zero = quantize_int4(w, 64)
    assert torch.equal(unpack_int4(pack_int4(codes)), codes)
    q = torch.randint(0, 256, (32, 64), dtype=torch.int32)
    assert torch.equal(unpack_int8(pack_int8(q)), q)
    q6 = torch.randint(0, 64, (48, 96), dtype=torch.int32)
    assert torch.equal(unpack_int6(pack_int6(q6)), q6) and pack_int6(q6).shape == (3, 96 // 16 * 3, 64)
    m = build_linear(w, None, "int4", 64, activations="int8")
    assert m.scales.dtype == m.zoffs.dtype == torch.float16
    zoff_rounding = 2 ** -11 * (zero.float() - 8 * scale.float()).abs().max().item()  # zoff is kept in fp16
    torch.testing.assert_close(m.dequantize(), dequantize_int4(codes, scale, zero, 64), rtol=0, atol=zoff_rounding)


@pytest.mark.parametrize("fmt,bits", [("int4", 4), ("int8", 8)])
def test_fp16_and_fp32_scales_give_the_same_bits(fmt, bits):
    m = build_linear(make_weight(192, 576), None, fmt, 32, activations="int8")
    x = make_x(9, 576)
    s16, z16 = m.scales.half(), m.full_zoffs().half()
    y16 = torch.ops.cpuserve.vnni_gemm(x, m.packed, s16, z16, bits, m.act_group)
    assert torch.equal(y16, torch.ops.cpuserve.vnni_gemm(x, m.packed, s16.float(), z16.float(), bits, m.act_group))
    with pytest.raises(RuntimeError, match="zoffs must be like scales"):
        torch.ops.cpuserve.vnni_gemm(x, m.packed, s16, z16.float(), bits, m.act_group)


def test_scales_are_fp16_only_where_fp16_holds_them_exactly():
    d = torch.rand(32, 4).half().float()  # a GGUF block's fp16 scale and min convert exactly
    scale, zoff = compact_scales(d, -d)
    assert scale.dtype == zoff.dtype == torch.float16
    scale, zoff = compact_scales(d, d / 3)  # not representable in fp16: both stay fp32
    assert scale.dtype == zoff.dtype == torch.float32
    assert torch.equal(_unblocked(zoff), d / 3)


def test_inexact_scales_round_to_fp16_only_in_its_normal_range():
    d = torch.rand(32, 4) * 0.1 + 1e-3  # K-quant-like scales: not fp16 values, all in fp16's normal range
    scale, zoff = compact_scales(d, -8 * d, exact=False)
    assert scale.dtype == zoff.dtype == torch.float16
    for got, want in ((scale, d), (zoff, -8 * d)):  # each within 2**-11 of itself
        assert ((_unblocked(got).float() - want).abs() <= want.abs() * 2.0 ** -11).all()
    tiny = d.clone()
    tiny[3, 1] = 1e-6  # a subnormal in fp16: its rounding could move it by far more than 2**-11 of itself
    scale, zoff = compact_scales(tiny, -8 * d, exact=False)
    assert scale.dtype == zoff.dtype == torch.float32
    assert torch.equal(_unblocked(scale), tiny)


def test_symmetric_small_scales_are_shifted_into_fp16s_normal_range():
    """Q6_K-like scales reaching below 2**-14: stored times 2**e in fp16 (each within 2**-11 of itself), and the
    kernel's output divides 2**e out again."""
    gen = torch.Generator().manual_seed(3)
    d = torch.rand(96, 32, generator=gen) * 1e-3 + 1e-6
    scale, header = compact_scales(d, -32 * d, exact=False, bits=6)
    z, e = header.tolist()
    assert scale.dtype == torch.float16 and z == 32 and e > 0 and float(d.min()) * 2.0 ** e >= 2.0 ** -14
    assert ((_unblocked(scale).float() * 2.0 ** -e - d).abs() <= d * 2.0 ** -11).all()
    codes = torch.randint(0, 64, (96, 512), generator=gen, dtype=torch.uint8)
    m = to_linear(CodedWeight(codes, d, -32 * d, 16, 8, "test"), "int4")
    assert m.zoffs.tolist() == [32, e] and m.scales.dtype == torch.float16
    for rows in (1, 9, 33):
        x = make_x(rows, 512)
        assert_matches_reference(m(x), int8_act_reference(x, codes, d, -32 * d, 16))


def test_row_quantization_reference():
    x = torch.tensor([[0.0, 1.0, -2.0, 0.5] * 8, [0.0] * 32])
    q, s = quantize_rows(x, 32)
    assert q[0, :4].tolist() == [0, 64, -127, 32] and s[0, 0].item() == pytest.approx(2 / 127)
    assert q[1].abs().sum() == 0 and s[1, 0] == 0  # an all-zero row stays zero, no division by zero


def test_shapes_the_kernel_refuses_keep_bf16_activations():
    assert not isinstance(build_linear(make_weight(200, 576), None, "int4", 32, activations="int8"), W4A8Linear)
    assert not isinstance(build_linear(make_weight(192, 48), None, "int8", activations="int8"), W8A8Linear)
    assert isinstance(build_linear(make_weight(192, 576), None, "int4", 32, activations="bf16").packed, torch.Tensor)
    assert not isinstance(build_linear(make_weight(192, 576), None, "int4", 32, activations="bf16"), W4A8Linear)


def test_bad_activations_value_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="activations='fp8'.*int8, int8-token, bf16"):
        EngineConfig(activations="fp8")
    with pytest.raises(ValueError, match="activations must be one of"):
        build_linear(make_weight(16, 32), None, "int4", 32, activations="int4")


def test_engine_default_multiplies_int8_activations_in_every_linear(llm_int4):
    model = llm_int4.engine.runner.model
    layers = [m for m in model.modules() if hasattr(m, "fmt")]
    assert layers and all(isinstance(m, (W4A8Linear, W8A8Linear)) for m in layers), layers[:3]
    assert isinstance(model.lm_head, W8A8Linear)
    assert model.lm_head.zoffs.tolist() == [128, 0]  # the file's Q8_0: symmetric, its zero code kept, fp16 scales
    assert model.embed_tokens.codes is model.lm_head  # tied: the lookup reads the lm_head's codes, no bf16 table
    ids = torch.tensor([0, 1, 2, 49151])
    assert torch.equal(model.embed(ids), model.lm_head.dequantize()[ids].to(torch.bfloat16))
