"""QuantLinear: every format against its own dequantized weight, fast path vs fallback, the int4 RTN bound."""
import pytest
import torch
import torch.nn.functional as F

from cpuserve.engine.layers import native
from cpuserve.engine.layers.linear import QuantLinear, build_linear

# The bf16 formats return bf16: one output rounding (2^-9 relative) plus kernel-side bf16 rounding of the
# dequantized weight in some paths. 1% of the output's max magnitude catches any wrong scale, zero point or
# code layout (those err by tens of percent) while leaving room for that rounding.
BF16_TOL = 1e-2
FP32_TOL = 1e-5


def make_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # a per-row offset makes the int4 zero points matter (a symmetric weight would hide a wrong zero)
    w = torch.randn(n, k, generator=gen) * 0.05 + torch.randn(n, 1, generator=gen) * 0.02
    return w, torch.randn(n, generator=gen)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def reference(m: QuantLinear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    b = None if bias is None else bias.to(m.act_dtype).float()
    return F.linear(x.to(m.act_dtype).float(), m.dequantize(), b)


@pytest.mark.parametrize("fmt", ["int4", "int8", "bf16", "fp32"])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (192, 576)])
@pytest.mark.parametrize("m_rows", [1, 7, 64])
def test_each_format_matches_its_dequantized_weight(fmt, n, k, m_rows):
    w, b = make_weight(n, k)
    m = build_linear(w, b, fmt, group_size=32)
    assert not m.is_fallback
    x = torch.randn(m_rows, k)
    y = m(x)
    assert y.shape == (m_rows, n) and y.dtype == m.act_dtype
    assert rel_err(y, reference(m, x, b)) < (FP32_TOL if fmt == "fp32" else BF16_TOL)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("group_size", [32, 128])
def test_fast_path_and_fallback_agree(fmt, group_size):
    w, b = make_weight(576, 1536, seed=1)
    fast = build_linear(w, b, fmt, group_size)
    slow = build_linear(w, b, fmt, group_size, use_fallback=True)
    assert not fast.is_fallback and slow.is_fallback
    x = torch.randn(3, 5, 1536, dtype=torch.bfloat16)  # leading dims are kept
    y_fast, y_slow = fast(x), slow(x)
    assert y_fast.shape == y_slow.shape == (3, 5, 576)
    assert rel_err(y_fast, y_slow.float()) < 2 * BF16_TOL
    # same quantized values: the fallback's bf16 weight is the fast weight rounded to bf16
    assert torch.allclose(slow.dequantize(), fast.dequantize(), rtol=2 ** -8, atol=0)


@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_error_within_rtn_bound(group_size):
    w, _ = make_weight(64, 512, seed=2)
    d = build_linear(w, None, "int4", group_size).dequantize()
    wg = w.view(64, -1, group_size)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    # RTN: half a step; plus bf16 rounding (2^-9 relative) of the stored scale and zero point, which can
    # shift the group's 16 levels by at most 2^-9 * (|zero| + 15 * step) at the range's ends.
    bound = 0.5 * step * (1 + 2 ** -8) + 2 ** -9 * (lo.abs() + 24 * step) + 1e-7
    err = (d.view_as(wg) - wg).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
    assert err.max() > 0.2 * step.max()  # really quantized (not a float copy)


def test_int8_error_within_half_step():
    w, _ = make_weight(128, 256, seed=3)
    d = build_linear(w, None, "int8").dequantize()
    step = w.abs().amax(-1, keepdim=True) / 127
    assert ((d - w).abs() <= 0.5 * step * (1 + 2 ** -7) + 2 ** -9 * w.abs()).all()


@pytest.mark.parametrize("fmt,n,k", [("int4", 30, 576), ("int4", 64, 100), ("int8", 64, 40), ("int8", 17, 33)])
def test_misfit_shapes_run_on_the_fallback(fmt, n, k):
    w, b = make_weight(n, k, seed=4)
    m = build_linear(w, b, fmt, group_size=32)
    assert m.is_fallback
    x = torch.randn(4, k)
    assert rel_err(m(x), reference(m, x, b)) < BF16_TOL
    assert (m.dequantize() - w).abs().max() < (w.abs().max() / 127 if fmt == "int8" else 0.05)


def test_fp32_keeps_fp32_and_bf16_input_is_not_copied():
    w, b = make_weight(32, 64)
    m = build_linear(w, b, "fp32")
    assert m(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.float32
    assert torch.equal(m.dequantize(), w)
    q = build_linear(w, None, "int8")
    assert q(torch.randn(2, 64)).dtype == torch.bfloat16


@pytest.mark.parametrize("kwargs,field", [
    ({"fmt": "int3"}, "fmt"), ({"fmt": "int4", "group_size": 48}, "group_size"),
    ({"fmt": "int8", "group_size": 0}, "group_size"),
])
def test_bad_arguments_raise_value_error_naming_the_field(kwargs, field):
    w, _ = make_weight(32, 64)
    with pytest.raises(ValueError, match=field) as info:
        build_linear(w, None, **kwargs)
    assert "int4" in str(info.value) or "32" in str(info.value)  # lists the allowed values


@pytest.mark.parametrize("n", [960, 80, 48, 176])  # whole 64-column blocks, a 16-column tail, tail only, 2 + 48
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16, 17, 33, 300])  # register passes of 4 / 8 rows; the tile from 17
@pytest.mark.parametrize("threads", [1, 2])  # 2: fewer than 4 blocks per thread make half-block tasks
def test_int4_kernel_is_torch_kernel_bit_for_bit(n, rows, threads):
    assert native.int4_gemm_enabled(), "the int4 GEMM kernel must build and pass its layout check here"
    w, b = make_weight(n, 576, seed=3)
    m = build_linear(w, b, "int4", group_size=32)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours = m(x)  # the C++ kernel at every row count
    finally:
        torch.set_num_threads(before)
    torch_kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x, m.packed, 32, m.scales_and_zeros) + b.bfloat16()
    assert rel_err(ours, reference(m, x, b)) < BF16_TOL
    # torch's arithmetic operation for operation: a row's tokens never depend on which kernel its step took
    assert torch.equal(ours, torch_kernel)


@pytest.mark.parametrize("group_size", [64, 128, 256])
@pytest.mark.parametrize("rows", [1, 6, 40])
def test_int4_kernel_is_torch_kernel_for_every_group_size(group_size, rows):
    w, _ = make_weight(208, 1024, seed=7)
    m = build_linear(w, None, "int4", group_size=group_size)
    x = torch.randn(rows, 1024).to(torch.bfloat16)
    want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, m.packed, group_size, m.scales_and_zeros)
    assert torch.equal(m(x), want)


@pytest.mark.parametrize("rows", [1, 40])  # registers, tile
def test_int4_kernel_columns_do_not_depend_on_the_shard(rows):
    """A replica rank holding some output columns must compute them bit for bit as one rank holding all."""
    w, _ = make_weight(208, 576, seed=4)
    full = build_linear(w, None, "int4", group_size=32)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    y = full(x)
    for lo, hi in ((64, 208), (0, 48), (128, 144)):  # block-aligned, a tail-only shard, a 16-column shard
        shard = build_linear(w[lo:hi], None, "int4", group_size=32)
        assert torch.equal(shard(x), y[:, lo:hi]), f"columns {lo}:{hi}"


@pytest.mark.parametrize("n", [576, 49152 // 64 + 3])  # whole 16-column tiles, and a tail
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 33])  # passes of 4 rows, and the last 1-3
def test_int8_kernel_is_torch_kernel_bit_for_bit(n, rows):
    assert native.int8_gemm_enabled(), "the int8 GEMM kernel must build and pass its check here"
    w, b = make_weight(n, 576, seed=5)
    m = build_linear(w, b, "int8")
    x = torch.randn(rows, 576).to(torch.bfloat16)
    ours = m(x)  # the C++ kernel at every row count
    assert torch.equal(ours, torch._weight_int8pack_mm(x, m.weight_int8, m.scales) + b.bfloat16())
    assert rel_err(ours, reference(m, x, b)) < BF16_TOL


@pytest.mark.parametrize("fmt,fallback", [("int4", False), ("int8", False), ("bf16", False), ("fp32", False),
                                          ("int4", True)])
@pytest.mark.parametrize("rows", [1, 8, 24, 33])
@pytest.mark.parametrize("with_bias", [True, False])
def test_out_gives_the_same_bits_in_place(fmt, fallback, rows, with_bias):
    """out= (a replica group writing into its shared-memory slot) changes where the result goes, not its bits."""
    assert native.int4_gemm_enabled() and native.int8_gemm_enabled()
    w, b = make_weight(80, 576, seed=6)  # N=80: a 16-column tail in the int4 and int8 kernels
    m = build_linear(w, b if with_bias else None, fmt, group_size=32, use_fallback=fallback)
    x = torch.randn(rows, 576)
    arena = torch.full((3 + rows * 80,), 7.0, dtype=m.act_dtype)  # out sits at an offset, like a slot
    out = arena[3:].view(rows, 80)
    got = m(x, out=out)
    assert got is out and torch.equal(out, m(x)) and (arena[:3] == 7).all()
    assert m.can_write_into(rows)  # every format writes in place at every row count (our kernels have out=)
    out3 = arena[3:].view(1, rows, 80)  # a leading batch dimension
    assert m(x[None], out=out3) is out3 and torch.equal(out3[0], m(x))


def test_out_of_the_wrong_shape_raises_naming_the_right_one():
    m = build_linear(*make_weight(80, 576), "int4")
    with pytest.raises(ValueError, match=r"shape \(4, 80\), got torch.bfloat16 \(4, 64\)"):
        m(torch.randn(4, 576), out=torch.empty(4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not contiguous"):
        m(torch.randn(4, 576), out=torch.empty(80, 4, dtype=torch.bfloat16).t())
    with pytest.raises(RuntimeError, match=r"out must be contiguous bf16 \[M, N\] = \[24, 80\]"):
        torch.ops.cpuserve.int4_gemm.out(torch.randn(24, 576).bfloat16(), m.packed, 32, m.scales_and_zeros,
                                         out=torch.empty(24, 64, dtype=torch.bfloat16))
    m8 = build_linear(*make_weight(80, 576), "int8")
    with pytest.raises(RuntimeError, match=r"out must be contiguous bf16 \[M, N\] = \[8, 80\]"):
        torch.ops.cpuserve.int8_gemm.out(torch.randn(8, 576).bfloat16(), m8.weight_int8, m8.scales,
                                         out=torch.empty(8, 80))


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_out_without_our_kernels_copies_torchs_result(fmt, monkeypatch):
    """Where our GEMMs are not built, torch's kernels (no out=) run and out= gets their result by one copy."""
    w, b = make_weight(80, 576, seed=8)
    m = build_linear(w, b, fmt, group_size=32)
    x = torch.randn(3, 576)
    ours = m(x)
    monkeypatch.setattr(native, f"{fmt}_gemm_enabled", lambda: False)
    assert not m.can_write_into(3)
    out = torch.empty(3, 80, dtype=torch.bfloat16)
    assert m(x, out=out) is out and torch.equal(out, ours)
