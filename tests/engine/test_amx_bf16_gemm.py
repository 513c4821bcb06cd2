"""The prompt rows' GEMM on AMX-BF16 (engine/csrc/amx_bf16_gemm.cpp) against the plain-torch reference: the layer's
weights dequantized in fp32, rounded to bf16, times the bf16 activations with fp32 sums. Every code form the layers
keep (4-, 6- and 8-bit file codes, symmetric and with offsets, the engine's own int4 / int8, the K-quants' factored
scales); a row's bits never depend on the rows beside it, the row count, the threads or out='s stride.

Where the CPU has AMX-BF16 the instructions run; everywhere the build has AVX-512 BF16 their software model does
(amx_tiles.h AmxEmu: its addressing and tile shapes; it follows the instruction set reference's order of additions,
which the hardware's rounding does not always match, so it is held to the reference's bound, never to the
hardware's bits)."""
import gguf
import pytest
import torch
from kquant_factory import real_blocks

from cpuserve.engine.layers import native
from cpuserve.engine.layers.linear import build_linear
from cpuserve.engine.loader.gguf_codes import decode_codes
from test_int8_activations import coded_layer, make_weight, make_x

op = torch.ops.cpuserve
pytestmark = pytest.mark.skipif(not native.vnni_gemm_enabled(), reason="needs the AVX-512 kernels")


def _modes() -> list[str]:
    before = op.amx_bf16_gemm_mode("")
    modes = []
    try:
        if op.amx_bf16_gemm_mode("emulate") == "emulate":
            modes.append("emulate")
    except RuntimeError:  # a build without AVX-512 BF16 has neither
        return []
    if op.amx_bf16_gemm_mode("auto") == "hw":
        modes.append("auto")
    op.amx_bf16_gemm_mode({"hw": "auto"}.get(before, before))
    return modes


MODES = _modes() if native.vnni_gemm_enabled() else []


@pytest.fixture(params=MODES or [pytest.param("none", marks=pytest.mark.skip(reason="no AVX-512 BF16 in this build"))])
def mode(request):
    before = op.amx_bf16_gemm_mode("")
    op.amx_bf16_gemm_mode(request.param)
    yield request.param
    op.amx_bf16_gemm_mode({"hw": "auto"}.get(before, before))


def gemm(m, x, out=None):
    args = (x, m.packed, m.scales, m.zoffs, m.bits, m.act_group, m.supers)
    return op.amx_bf16_gemm(*args) if out is None else op.amx_bf16_gemm.out(*args, out=out)


def assert_matches_reference(m, x, y):
    """|y - ref| within half a bf16 step of ref (the output's rounding) plus 2^-12 of sum |x| |w| (the fp32 sums'
    order, and a weight rounded to bf16 from an fp32 one step apart: the kernel's fused multiply-add)."""
    w = m.dequantize()
    ref = x.float() @ w.to(torch.bfloat16).float().t()
    bound = ref.abs() * 2.0 ** -8 + (x.float().abs() @ w.abs().t()) * 2.0 ** -12
    excess = (y.float() - ref).abs() - bound
    assert excess.max() <= 0, f"worst excess {excess.max():.3g} over the bound"


def kquant_layer(qtype: str, n: int = 112, k: int = 1024):
    coded = decode_codes(real_blocks(qtype, (n, k), 0), gguf.GGMLQuantizationType[qtype], (n, k))
    return build_linear(coded, None, "int4", activations="int8")


LAYERS = {
    "q4_1": lambda: coded_layer(4, 32, None, n=112),  # 7 column blocks: the last tile has one
    "q4_0": lambda: coded_layer(4, 32, 8, n=112),
    "int4_g16": lambda: coded_layer(4, 16, None, n=112),
    "six_bit_sym": lambda: coded_layer(6, 16, 32, n=112),
    "six_bit": lambda: coded_layer(6, 16, None, n=112),
    "q8_0": lambda: coded_layer(8, 32, 128, n=112),
    "own_int4": lambda: build_linear(make_weight(576, 576), None, "int4", 32, activations="int8"),
    "own_int4_g128": lambda: build_linear(make_weight(96, 512), None, "int4", 128, activations="int8"),
    "own_int8": lambda: build_linear(make_weight(160, 1536), None, "int8", 32, activations="int8"),
    **{q: (lambda q=q: kquant_layer(q)) for q in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")},
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_every_code_form_matches_the_reference(mode, name):
    m = LAYERS[name]()
    for rows in (1, 16, 45, 64):  # one row (padded), whole blocks of 16 and 32, a remainder beside them
        x = make_x(rows, m.in_features)
        assert_matches_reference(m, x, gemm(m, x))


@pytest.mark.parametrize("name", ["q4_1", "six_bit", "Q4_K"])
def test_a_row_does_not_depend_on_the_batch_the_threads_or_the_stride(mode, name):
    m = LAYERS[name]()
    x = make_x(45, m.in_features)
    batched = gemm(m, x)
    assert torch.equal(torch.cat([gemm(m, x[i:i + 1]) for i in range(45)]), batched)
    assert torch.equal(gemm(m, x[:17]), batched[:17])
    shuffled = torch.randperm(45, generator=torch.Generator().manual_seed(0))
    assert torch.equal(gemm(m, x[shuffled]), batched[shuffled])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gemm(m, x), batched)
    finally:
        torch.set_num_threads(threads)
    wide = torch.full((45, m.out_features + 64), float("nan"), dtype=torch.bfloat16)
    part = wide[:, 32:32 + m.out_features]  # a block of columns of a wider output: rows of stride N + 64
    assert gemm(m, x, out=part) is part and torch.equal(part, batched)
    assert wide[:, :32].isnan().all() and wide[:, 32 + m.out_features:].isnan().all()


@pytest.mark.parametrize("name,k,rows", [("q4_0", 2048, 300), ("Q4_K", 4608, 150)])
def test_a_long_prompt_through_wide_panels_gives_each_row_its_bits_alone(mode, name, k, rows):
    """x past the kernel's 1 MB L2 budget with 32 column blocks: panels of several column pairs over x packed in tile
    order, the next rows prefetched, the last 32-row block part empty; at 4608 inputs K in three spans, the sums
    leaving the tiles between them. Each row's bits are those of the row alone (one row: a pair a panel, x's own
    rows), whatever the threads, and within the reference's bound."""
    m = coded_layer(4, 32, 8, n=512, k=k) if name == "q4_0" else kquant_layer("Q4_K", n=512, k=k)
    x = make_x(rows, k)
    batched = gemm(m, x)
    assert_matches_reference(m, x, batched)
    for i in (0, 15, 16, 31, 32, 127, 128, rows - 7, rows - 1):
        assert torch.equal(gemm(m, x[i:i + 1]), batched[i:i + 1]), f"row {i}"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gemm(m, x), batched)
    finally:
        torch.set_num_threads(threads)


def test_the_instructions_run_where_the_cpu_has_them():
    """CPUSERVE_AMX's "auto": the instructions exactly where the CPU reports AMX-BF16 and Linux grants the tiles."""
    if not MODES:
        pytest.skip("no AVX-512 BF16 in this build")
    flags = open("/proc/cpuinfo").read()
    before = op.amx_bf16_gemm_mode("")
    try:
        assert op.amx_bf16_gemm_mode("auto") == ("hw" if " amx_bf16" in flags and " amx_tile" in flags else "off")
        assert op.amx_bf16_gemm_mode("off") == "off" and not op.amx_bf16_gemm_supported()
    finally:
        op.amx_bf16_gemm_mode({"hw": "auto"}.get(before, before))


def test_bad_operands_are_refused_by_name(mode):
    m = LAYERS["q4_1"]()
    with pytest.raises(RuntimeError, match=r"x must be contiguous bf16 \[M, 512\]"):
        gemm(m, make_x(3, 512).float())
    with pytest.raises(RuntimeError, match="out must be bf16"):
        gemm(m, make_x(3, 512), out=torch.empty(3, 100, dtype=torch.bfloat16))
    odd = coded_layer(4, 16, None, n=32, k=528)  # K = 528: 16 inputs past the last whole step of 32
    with pytest.raises(RuntimeError, match="K=528 must be a multiple of 32"):
        gemm(odd, make_x(3, 528))
    with pytest.raises(RuntimeError, match="mode must be off, auto or emulate"):
        op.amx_bf16_gemm_mode("on")
    op.amx_bf16_gemm_mode("off")
    with pytest.raises(RuntimeError, match="needs AMX-BF16"):
        gemm(m, make_x(3, 512))
