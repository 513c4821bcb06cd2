"""The int8 GEMMs' AMX path (engine/csrc/vnni_amx_rows.h amx_rows, engine/csrc/amx_tiles.h) against their register
blocks: the same bits for every form it takes, every row count, the last tile of one column block.

On a CPU without AMX the path runs through the tiles' software model (AmxEmu), so its addressing, tile shapes and
epilogue are checked here too; where the CPU has AMX the instructions themselves are checked the same way."""
import gguf
import kernel_paths
import pytest
import torch
from kquant_factory import real_blocks

from cpuserve.engine.layers import native
from cpuserve.engine.layers.linear import build_linear
from cpuserve.engine.loader.gguf_codes import decode_codes
from test_int8_activations import coded_layer, make_weight, make_x

pytestmark = pytest.mark.skipif(native.vnni_gemm_isa() != "avx512_vnni",
                                reason="the AMX tiles belong to the AVX-512 level's int8 GEMMs")
# from kAmxMinRows (vnni_column_tiles.h): whole 16-row tile blocks and remainders beside them
ROWS = [128, 129, 143, 160]


@pytest.fixture
def amx_modes():
    """The modes to check against "off": the software model always, the instructions where this CPU has them."""
    before = torch.ops.cpuserve.vnni_gemm_amx("")
    modes = ["emulate"]
    if torch.ops.cpuserve.vnni_gemm_amx("auto") == "hw":
        modes.append("auto")
    yield modes
    torch.ops.cpuserve.vnni_gemm_amx({"hw": "auto"}.get(before, before))


def run(m, x, mode: str) -> tuple[torch.Tensor, int]:
    """m(x) with the AMX path in `mode`, and how many 16-row blocks went through tiles."""
    in_force = torch.ops.cpuserve.vnni_gemm_amx(mode)
    before = torch.ops.cpuserve.vnni_gemm_amx_blocks()
    y = m(x)
    blocks = torch.ops.cpuserve.vnni_gemm_amx_blocks() - before
    if blocks and in_force in ("hw", "emulate"):
        kernel_paths.note({"hw": "amx_tiles_hw", "emulate": "amx_tiles_model"}[in_force])
    return y, blocks


def assert_same_bits(m, k: int, n: int, modes: list[str]) -> None:
    tiles = (n // 16 + 1) // 2  # two column blocks a tile
    for rows in ROWS:
        x = make_x(rows, k)
        want, none = run(m, x, "off")
        assert none == 0
        for mode in modes:
            got, blocks = run(m, x, mode)
            assert blocks == rows // 16 * tiles, (mode, rows, blocks)  # every whole 16 rows of every tile took tiles
            assert torch.equal(got, want), (mode, rows, (got.float() - want.float()).abs().max())


@pytest.mark.parametrize("bits,group,zero", [(4, 32, None), (4, 32, 8), (4, 16, None), (4, 64, None),
                                             (6, 16, 32), (6, 16, None), (8, 32, 128)])
def test_file_codes_on_tiles_give_the_register_blocks_bits(amx_modes, bits, group, zero):
    """A file's codes (Q4_1's offsets, Q4_0's zero code, 6- and 8-bit codes), groups of 16-64; 7 column blocks"""
    m = coded_layer(bits, group, zero, n=112)
    assert_same_bits(m, 512, 112, amx_modes)


@pytest.mark.parametrize("fmt,group,n,k,activations", [("int4", 32, 576, 576, "int8"), ("int4", 128, 576, 512, "int8"),
                                                        ("int8", 32, 1536, 576, "int8"), ("int8", 32, 80, 1536, "int8"),
                                                        ("int8", 32, 1536, 576, "int8-token"),
                                                        ("int8", 32, 80, 1536, "int8-token")])
def test_the_engines_own_weights_on_tiles_give_the_register_blocks_bits(amx_modes, fmt, group, n, k, activations):
    """A float checkpoint's weights as the engine quantizes them: int4 in groups of 32 and 128 (two tile steps a
    group), int8 one scale per channel, and vLLM's W8A8 scheme (one activation group a row: the sums stay in the
    tiles over all of K)"""
    m = build_linear(make_weight(n, k), torch.randn(n), fmt, group, activations=activations)
    assert m.act_group == (k if activations == "int8-token" else group)
    assert_same_bits(m, k, n, amx_modes)


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_on_tiles_give_the_register_blocks_bits(amx_modes, qtype):
    """A K-quant file's blocks (kquant_factory: real block layouts): its groups of 16 or 32 on tiles inside the
    activations' super-blocks of 256, the factored scales and the sub-mins' integer zero term as the registers take
    them; 7 column blocks"""
    n, k = 112, 1024
    coded = decode_codes(real_blocks(qtype, (n, k), 0), gguf.GGMLQuantizationType[qtype], (n, k))
    m = build_linear(coded, None, "int4", activations="int8")
    assert m.supers is not None and m.act_group == 256
    assert_same_bits(m, k, n, amx_modes)


@pytest.mark.parametrize("bits,group,zero", [(4, 32, None), (6, 16, 32), (6, 64, 16)])
def test_activation_groups_over_stored_weight_groups_on_tiles(amx_modes, bits, group, zero):
    """Activation groups of 256 over stored weight groups of 16-64 (block_nested without factored scales)"""
    m = coded_layer(bits, group, zero, n=112)
    m.act_group = 256
    assert_same_bits(m, 512, 112, amx_modes)


def test_a_row_on_tiles_does_not_depend_on_the_batch(amx_modes):
    m = coded_layer(4, 32, None, n=112)
    x = make_x(136, 512)
    for mode in amx_modes:
        batched, blocks = run(m, x, mode)
        assert blocks > 0
        alone = torch.cat([run(m, x[i:i + 1], mode)[0] for i in range(136)])
        assert torch.equal(batched, alone)


def test_the_load_time_probe_passes_on_tiles(amx_modes):
    """What vnni_gemm_enabled runs once where the CPU has AMX, before it keeps the tiles"""
    for mode in amx_modes:
        assert native.amx_reproduces_registers(mode)


def test_an_unknown_mode_is_refused_naming_it():
    with pytest.raises(RuntimeError, match="mode must be off, auto or emulate, got on"):
        torch.ops.cpuserve.vnni_gemm_amx("on")


@pytest.mark.slow
def test_smollm2_scores_on_tiles_are_the_register_blocks(amx_modes, llm_int4):
    """The whole default model, 140 prompt tokens on the int8 path (the prompt rows' bf16 tiles off): every layer's
    logits bit for bit"""
    ids = llm_int4.tokenizer.encode("The int8 GEMMs of a prefill take AMX tiles where the CPU has them. " * 12)[:140]
    assert len(ids) == 140
    bf16_before = torch.ops.cpuserve.amx_bf16_gemm_mode("")
    try:
        torch.ops.cpuserve.amx_bf16_gemm_mode("off")
        torch.ops.cpuserve.vnni_gemm_amx("off")
        want = llm_int4.engine.score(ids)
        for mode in amx_modes:
            torch.ops.cpuserve.vnni_gemm_amx(mode)
            before = torch.ops.cpuserve.vnni_gemm_amx_blocks()
            got = llm_int4.engine.score(ids)
            assert torch.ops.cpuserve.vnni_gemm_amx_blocks() - before > 0
            assert torch.equal(got, want), mode
    finally:
        torch.ops.cpuserve.amx_bf16_gemm_mode({"hw": "auto"}.get(bf16_before, bf16_before))


def test_below_the_tiles_row_count_the_register_blocks_run(amx_modes):
    """Batched decode (17-127 rows) stays on the register blocks, where the tiles measured no faster"""
    m = coded_layer(4, 32, None, n=112)
    for rows in (17, 64, 127):
        x = make_x(rows, 512)
        want, _ = run(m, x, "off")
        for mode in amx_modes:
            got, blocks = run(m, x, mode)
            assert blocks == 0 and torch.equal(got, want), (mode, rows, blocks)


@pytest.mark.parametrize("n,k", [(1536, 576), (80, 1536)])
def test_per_token_sums_take_the_tiles_from_32_rows(amx_modes, n, k):
    """vLLM's W8A8 scheme ("int8-token") keeps its sums in the tiles over all of K, with no per-group epilogue, so the
    tiles take it from kAmxTokenMinRows (32) rows: batched decode at 32 streams too. Below that, register blocks."""
    m = build_linear(make_weight(n, k), torch.randn(n), "int8", 32, activations="int8-token")
    tiles = (n // 16 + 1) // 2
    for rows in (17, 31, 32, 33, 47, 64):
        x = make_x(rows, k)
        want, none = run(m, x, "off")
        assert none == 0
        for mode in amx_modes:
            got, blocks = run(m, x, mode)
            assert blocks == (rows // 16 * tiles if rows >= 32 else 0), (mode, rows, blocks)
            assert torch.equal(got, want), (mode, rows, (got.float() - want.float()).abs().max())
