"""A prompt's MLP in one kernel on AMX-BF16 (amx_bf16_gemm_silu: gate_up's GEMM with silu(gate) * up in its
epilogue, no [M, N] output in between) gives the bits of the two steps it replaces, silu_mul over amx_bf16_gemm, for
every code form, row count, thread count and output stride; QuantLinear.silu_mul_into gives those of
silu_mul(forward(x, prompt_rows=)) with prompt rows and other rows mixed. The GEMM itself is held to its reference
in test_amx_bf16_gemm.py."""
import pytest
import torch

from cpuserve.engine.layers import native
from cpuserve.engine.layers.linear import build_linear
from test_amx_bf16_gemm import MODES, gemm, kquant_layer, mode  # noqa: F401 (mode: the fixture)
from test_int8_activations import coded_layer, make_weight, make_x

op = torch.ops.cpuserve
pytestmark = pytest.mark.skipif(not MODES, reason="no AVX-512 BF16 in this build (or no AVX-512 kernels)")

LAYERS = {  # [gate | up], each half whole column blocks of 16
    "q4_1": lambda: coded_layer(4, 32, None, n=96),
    "q4_0": lambda: coded_layer(4, 32, 8, n=96),
    "six_bit": lambda: coded_layer(6, 16, None, n=96),
    "q8_0": lambda: coded_layer(8, 32, 128, n=96),
    "own_int4": lambda: build_linear(make_weight(3072, 576), None, "int4", 32, activations="int8"),
    "own_int8": lambda: build_linear(make_weight(160, 1536), None, "int8", 32, activations="int8"),
    **{q: (lambda q=q: kquant_layer(q, n=96)) for q in ("Q4_K", "Q6_K")},
}


def fused(m, x, out=None):
    out = torch.empty(x.shape[0], m.out_features // 2, dtype=torch.bfloat16) if out is None else out
    return op.amx_bf16_gemm_silu.out(x, m.packed, m.scales, m.zoffs, m.bits, m.act_group, m.supers, out=out)


def two_steps(m, x):
    return op.silu_mul(gemm(m, x))


@pytest.mark.parametrize("name", list(LAYERS))
def test_the_fused_kernel_gives_the_two_steps_bits(mode, name):
    m = LAYERS[name]()
    for rows in (1, 15, 16, 45, 64):  # padded, whole blocks of 16 and 32, a remainder beside them
        x = make_x(rows, m.in_features)
        assert torch.equal(fused(m, x), two_steps(m, x)), rows


def test_the_threads_and_the_output_stride_do_not_change_a_bit(mode):
    m = LAYERS["q4_1"]()
    x = make_x(45, m.in_features)
    want = two_steps(m, x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(fused(m, x), want)
    finally:
        torch.set_num_threads(threads)
    wide = torch.full((45, 48 + 64), float("nan"), dtype=torch.bfloat16)
    part = wide[:, 32:32 + 48]  # rows of stride 112
    assert fused(m, x, out=part) is part and torch.equal(part, want)
    assert wide[:, :32].isnan().all() and wide[:, 80:].isnan().all()


@pytest.mark.parametrize("ranges", [((0, 40),), ((1, 4), (15, 26)), ((3, 40),), ((0, 1), (39, 40))])
def test_silu_mul_into_mixes_prompt_rows_and_others_as_the_two_steps_do(mode, ranges, monkeypatch):
    monkeypatch.setenv("CPUSERVE_PROMPT_GEMM", "bf16")
    m = LAYERS["own_int4"]()
    assert m.has_prompt_silu_kernel()
    x = make_x(40, m.in_features)
    act = torch.empty(40, m.out_features // 2, dtype=torch.bfloat16)
    assert m.silu_mul_into(x, act, ranges) is act
    assert torch.equal(act, op.silu_mul(m(x, prompt_rows=ranges)))


def test_bad_operands_are_refused_by_name(mode):
    m = LAYERS["q4_1"]()
    with pytest.raises(RuntimeError, match=r"out must be bf16 \[3, 48\]"):
        fused(m, make_x(3, m.in_features), out=torch.empty(3, 96, dtype=torch.bfloat16))
    odd = coded_layer(4, 32, None, n=112)  # 7 column blocks: no whole gate and up halves
    with pytest.raises(RuntimeError, match="N=112 must be"):
        fused(odd, make_x(3, odd.in_features), out=torch.empty(3, 56, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"x must be contiguous bf16"):
        fused(m, make_x(3, m.in_features).float())


def test_the_layers_that_take_it(monkeypatch):
    monkeypatch.setenv("CPUSERVE_PROMPT_GEMM", "bf16")
    here = native.amx_bf16_gemm_enabled()
    assert LAYERS["q4_1"]().has_prompt_silu_kernel() == here
    assert not coded_layer(4, 32, None, n=112).has_prompt_silu_kernel()  # halves not whole column blocks
    monkeypatch.setenv("CPUSERVE_PROMPT_GEMM", "int8")
    assert not LAYERS["q4_1"]().has_prompt_silu_kernel()


def test_a_long_prompt_through_wide_panels_and_spans_gives_the_two_steps_bits(mode):
    """150 rows x 4608 inputs: past the 1 MB budget, so panels of several gate/up pairs over x packed in tile order,
    and K in three spans (the sums leave the tiles between them); the fused epilogue still gives the two steps' bits."""
    m = kquant_layer("Q4_K", n=512, k=4608)
    x = make_x(150, 4608)
    assert torch.equal(fused(m, x), two_steps(m, x))
