"""The fused C++ kernels (engine/csrc) against the plain-torch path they replace.

Decode attention is checked against the reference in test_attention.py; here: RoPE + KV write, RMSNorm (and the
residual add fused to it), SiLU * up, the out= variants, and the errors the kernels raise for inputs they cannot take.
"""
import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from cpuserve.engine.layers import kernel_build, native
from cpuserve.engine.layers.kv_quant import write_kv_fused
from cpuserve.engine.models.rope import apply_rope

ops = torch.ops.cpuserve


@pytest.fixture(scope="module", autouse=True)
def kernels():
    # a checkout's kernels are built by `make install` (g++ is the machine's): a failure here is real, not a skip
    assert native.available(), "the fused kernels did not build"


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def rope_inputs(dtype, n=7, heads=9, kv_heads=3, head_dim=64, num_blocks=6, block_size=4):
    qkv = rand(n, heads + 2 * kv_heads, head_dim, dtype=dtype, seed=1) * 3
    angles = rand(n, head_dim // 2, seed=2) * 5
    angles = torch.cat([angles, angles], -1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(3))[:n]
    return qkv, cos, sin, slots, (num_blocks, block_size, 2 * kv_heads, head_dim)


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache", [torch.int8, torch.bfloat16, torch.float32])
def test_rope_write_kv_matches_torch_path(act, cache):
    qkv, cos, sin, slots, shape = rope_inputs(act)
    heads = shape[2] // 2 * 3  # 9 query heads over 3 kv heads
    ref_qkv = qkv.clone()
    ref_qkv[:, : heads + 3] = apply_rope(ref_qkv[:, : heads + 3], cos[:, None], sin[:, None])
    pool = torch.zeros(shape, dtype=cache)
    scale = torch.zeros(shape[:3]) if cache == torch.int8 else None
    ops.rope_write_kv(qkv, cos, sin, heads, pool, scale, slots)

    # torch rounds each of x*cos, rot*sin and their sum to the activation dtype; the kernel rounds once:
    # a few bf16 ulps (2^-8 relative each) apart at most
    rel = 1e-6 if act == torch.float32 else 2e-2
    assert ((qkv.float() - ref_qkv.float()).abs() <= rel * ref_qkv.float().abs().clamp(min=1)).all()
    # the pool holds exactly what the torch writer makes of the kernel's rotated K and V rows
    ref_pool = torch.zeros(shape, dtype=cache)
    ref_scale = torch.zeros(shape[:3]) if cache == torch.int8 else None
    write_kv_fused(ref_pool, ref_scale, qkv[:, heads:], slots)
    assert torch.equal(pool, ref_pool)
    if cache == torch.int8:
        assert torch.equal(scale, ref_scale)
    assert pool.view(-1, *shape[2:])[slots].ne(0).any(-1).all()  # every new token's K and V rows landed


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rms_norm_matches_torch(dtype, tol):
    x, w = rand(5, 576, dtype=dtype, seed=4) * 4, rand(576, dtype=dtype, seed=5)
    want = F.rms_norm(x.float(), (576,), w.float(), 1e-5)
    got = ops.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype
    assert ((got.float() - want).abs() <= tol * want.abs().clamp(min=1)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_gives_the_bits_of_torchs_add_then_rms_norm(dtype):
    x, delta, w = rand(37, 576, dtype=dtype, seed=1), rand(37, 576, dtype=dtype, seed=2) * 3, rand(576, dtype=dtype)
    h, normed = ops.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(h, x + delta) and torch.equal(normed, ops.rms_norm(x + delta, w, 1e-5))
    with pytest.raises(RuntimeError, match="delta must have x's shape and dtype"):
        ops.add_rms_norm(x, delta[:5], w, 1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_silu_mul_matches_torch(dtype, tol):
    x = rand(3, 2 * 1536, dtype=dtype, seed=6) * 4
    gate, up = x.float().chunk(2, -1)
    want = F.silu(gate) * up
    got = ops.silu_mul(x)
    assert got.shape == (3, 1536) and got.dtype == dtype
    assert ((got.float() - want).abs() <= tol * want.abs().clamp(min=1)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_variants_write_the_same_bits_in_place(dtype):
    # a replica group passes its shared-memory slot as out: same bits as the allocating op, nothing else written
    x = rand(3, 2 * 1536, dtype=dtype, seed=6) * 4
    out = torch.full((3, 1536), 7.0, dtype=dtype)
    assert ops.silu_mul.out(x, out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out, ops.silu_mul(x))

    qkv, cos, sin, slots, shape = rope_inputs(dtype)
    pool, scale = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape[:3])
    ops.rope_write_kv(qkv, cos, sin, 9, pool, scale, slots)
    q = qkv[:, :9]  # rows with a stride, as in the model
    tables = torch.arange(6, dtype=torch.int32).view(1, 6).repeat(7, 1)
    lens = torch.tensor([1, 3, 5, 8, 13, 20, 24], dtype=torch.int32)
    want = ops.decode_attention(q, pool, scale, tables, lens, 0.125)
    big = torch.full((9, 9, 64), 7.0, dtype=dtype)  # out = the first 7 rows of a larger buffer
    ops.decode_attention.out(q, pool, scale, tables, lens, 0.125, out=big[:7])
    assert torch.equal(big[:7], want) and (big[7:] == 7).all()


@pytest.mark.parametrize("vocab", [49152, 1000, 7])  # whole vectors of 16, a remainder, only a remainder
def test_argmax_rows_is_torchs_first_maximum(vocab):
    x = rand(6, vocab, seed=4)
    x[1, vocab // 3] = x[1, vocab - 1] = 1e4  # a tie: the first one wins
    x[2] = float("-inf")  # all masked out
    x[2, vocab // 2] = 0.0
    x[3] = float("-inf")  # nothing allowed at all: index 0, as torch
    x[4, vocab - 1] = float("nan")  # NaN counts as the largest, as in torch.max
    x[5, 0] = x[5].max() + 1
    assert torch.equal(ops.argmax_rows(x), x.max(dim=-1).indices)
    with pytest.raises(RuntimeError, match="logits must be contiguous float32"):
        ops.argmax_rows(x.bfloat16())


def test_wrong_out_is_refused_naming_the_sizes():
    x = rand(3, 2 * 64)
    with pytest.raises(RuntimeError, match=r"out must be a contiguous CPU Float tensor of sizes \[3, 64\]"):
        ops.silu_mul.out(x, out=torch.empty(3, 65))
    with pytest.raises(RuntimeError, match="out must be a contiguous"):
        ops.silu_mul.out(x, out=torch.empty(64, 3).t())
    with pytest.raises(RuntimeError, match="out must be a contiguous"):
        ops.silu_mul.out(x, out=torch.empty(3, 64, dtype=torch.bfloat16))


def test_int8_pool_without_scales_is_refused():
    qkv, cos, sin, slots, shape = rope_inputs(torch.float32)
    with pytest.raises(RuntimeError, match="int8 pool needs fp32 scales"):
        ops.rope_write_kv(qkv, cos, sin, 9, torch.zeros(shape, dtype=torch.int8), None, slots)
    q = rand(1, 9, 64)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="int8 pool needs its scales"):
        ops.decode_attention(q, torch.zeros(shape, dtype=torch.int8), None, tables, lens, 0.125)


def test_wrong_dtypes_name_what_is_allowed():
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.rms_norm(torch.ones(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match="int32"):
        ops.decode_attention(rand(1, 9, 64), torch.zeros(2, 4, 6, 64), None, torch.zeros(1, 1, dtype=torch.int64),
                             torch.ones(1, dtype=torch.int32), 0.125)
    qkv, cos, sin, slots, shape = rope_inputs(torch.float32)
    with pytest.raises(RuntimeError, match="expected n_heads"):
        ops.rope_write_kv(qkv, cos, sin, 8, torch.zeros(shape), None, slots)


def test_mode_is_validated(monkeypatch):
    monkeypatch.setenv("CPUSERVE_KERNELS", "fast")
    with pytest.raises(ValueError, match="CPUSERVE_KERNELS='fast'.*auto, native, torch"):
        native.mode()
    monkeypatch.setenv("CPUSERVE_KERNELS", "torch")
    assert native.available() is False


# CPU flags as /proc/cpuinfo names them: x86-64-v4 (AVX-512 F/BW/CD/DQ/VL over AVX2's level)
V4 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave",
                "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})


V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})


@pytest.mark.parametrize("flags,forced,want", [
    (V4 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "avx_vnni"}, "", "avx512_bf16"),  # Sapphire Rapids
    (V4 | {"avx512_vnni", "avx512_bf16"}, "", "avx512_bf16"),  # Zen 4
    (V4 | {"avx512_vnni"}, "", "avx512_vnni"),  # Ice Lake
    (V4, "", "avx2"),  # Skylake-X: AVX-512 without VNNI
    (V3 | {"avx_vnni"}, "", "avx2_vnni"),  # Alder Lake, Sierra Forest
    (V3, "", "avx2"),  # Zen 2 and 3, Haswell
    (V4 | {"avx512_vnni", "avx512_bf16"}, "avx512_vnni", "avx512_vnni"),  # a lower level, forced
    (V4 | {"avx512_vnni", "avx512_bf16", "avx_vnni"}, "avx2_vnni", "avx2_vnni"),
    (V4 | {"avx512_vnni", "avx512_bf16"}, "avx2", "avx2"),
])
def test_the_level_is_the_best_the_cpu_runs_unless_a_lower_one_is_asked_for(flags, forced, want):
    assert native.select_level(frozenset(flags), forced=forced).name == want


def test_a_level_the_cpu_cannot_run_is_refused_by_name():
    with pytest.raises(RuntimeError, match="CPUSERVE_KERNEL_LEVEL=avx512_bf16: this CPU lacks avx512_bf16; "
                                           "it runs avx512_vnni"):
        native.select_level(V4 | {"avx512_vnni"}, forced="avx512_bf16")
    with pytest.raises(RuntimeError, match="CPUSERVE_KERNEL_LEVEL=avx2_vnni: this CPU lacks avx_vnni; "
                                           "it runs avx512_bf16, avx512_vnni, avx2"):
        native.select_level(V4 | {"avx512_vnni", "avx512_bf16"}, forced="avx2_vnni")  # Zen 4: no AVX-VNNI
    with pytest.raises(ValueError, match="kernel level 'avx3': the levels are avx512_bf16, avx512_vnni, avx2_vnni, "
                                         "avx2"):
        native.select_level(V4, forced="avx3")
    with pytest.raises(RuntimeError, match="runs none of the kernel levels"):
        native.select_level(frozenset({"avx", "avx2", "fma"}), forced="")  # AVX2 without FMA3's companions (F16C...)


@pytest.mark.parametrize("level,below,own", [
    ("avx512_bf16", "avx512_vnni", ["amx_bf16_gemm.cpp", "dense_gemm.cpp", "slim_attention.cpp"]),  # int8 GEMMs shared
    ("avx2_vnni", "avx2", ["vnni_gemm.cpp"]),  # avx2_gemm.h, the one user of AVX-VNNI
])
def test_a_level_over_another_compiles_only_the_sources_that_use_its_instructions(level, below, own):
    """A source gets a level's extra flags when it (or a header it includes) tests the level's macro; every other
    object is the level below's, compiled once for both, and no object of the two levels is named the same unless
    its flags are the same."""
    upper, lower = kernel_build.level_named(level), kernel_build.level_named(below)
    flags = kernel_build._flags
    assert [src.name for src in kernel_build.sources() if flags(upper, src) != flags(lower, src)] == own
    for name in own:
        assert set(upper.extra_flags) <= set(flags(upper, kernel_build.CSRC / name))
    toolchain = (b"torch", b"g++")
    shared = {src.name for src in kernel_build.sources()
              if kernel_build.object_name(upper, src, toolchain) == kernel_build.object_name(lower, src, toolchain)}
    assert shared == {src.name for src in kernel_build.sources()} - set(own)
    assert kernel_build.library_name(upper) != kernel_build.library_name(lower)


def test_an_edited_header_rebuilds_only_the_sources_that_include_it(tmp_path):
    """An object is named by its source and the headers it includes (transitively), not by every header."""
    csrc = tmp_path / "csrc"
    shutil.copytree(kernel_build.CSRC, csrc)
    level, toolchain = kernel_build.level_named("avx2"), (b"torch", b"g++")
    names = lambda: {src.name: kernel_build.object_name(level, src, toolchain) for src in sorted(csrc.glob("*.cpp"))}
    before = names()
    header = csrc / "amx_tiles.h"
    header.write_text(header.read_text() + "// an edited header\n")
    after = names()
    changed = sorted(name for name in before if before[name] != after[name])
    users = sorted(src.name for src in csrc.glob("*.cpp") if header in kernel_build.included(src))
    assert changed == users and "vnni_gemm.cpp" in users and "argmax.cpp" not in users


def test_the_loaded_library_is_the_level_chosen_for_this_cpu():
    import os

    want = os.environ.get("CPUSERVE_KERNEL_LEVEL") or kernel_build.runnable_levels(kernel_build.cpu_flags())[0].name
    assert native.level().name == want
    assert native.library_path().name.startswith(f"cpuserve_ops_{want}_") and native.library_path().is_file()


def test_another_checkout_of_the_same_sources_finds_the_built_library(tmp_path, monkeypatch):
    """A library is named by what went into it, never by where the checkout lies: nothing is built twice."""
    level, built = native.level(), native.library_path()
    checkout = tmp_path / "another-checkout" / "csrc"
    shutil.copytree(kernel_build.CSRC, checkout)
    monkeypatch.setattr(kernel_build, "CSRC", checkout)
    assert kernel_build.find_library(level) == built
    (checkout / "argmax.cpp").write_text((checkout / "argmax.cpp").read_text() + "// an edited kernel\n")
    assert kernel_build.find_library(level) is None  # an edit is built anew
    assert kernel_build.library_name(level) != built.name


@pytest.mark.slow
def test_each_lower_level_loads_and_reproduces_torchs_kernels():
    """Every other level this CPU runs, forced (CPUSERVE_KERNEL_LEVEL), in a process of its own (a process loads
    one level): its bf16 GEMMs give torch's bits where the level has them (AVX-512; the AVX2 levels use torch's) and
    its int8 GEMMs run (each *_enabled() probes that; with AMX, the tiles' bits against the register blocks')."""
    import os
    import sys

    lower = kernel_build.runnable_levels(kernel_build.cpu_flags())[1:]
    if not lower:
        pytest.skip("this CPU runs one kernel level only")
    code = ("from cpuserve.engine.layers import native; import torch; assert native.available(); "
            "print(native.level().name, native.int4_gemm_enabled(), native.int8_gemm_enabled(), "
            "native.vnni_gemm_enabled())")
    for level in lower:
        env = {**os.environ, "CPUSERVE_KERNEL_LEVEL": level.name, "CPUSERVE_KERNELS": "native"}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1500)
        assert done.returncode == 0, done.stderr[-3000:]
        avx512 = str("avx512f" in level.cpu_flags)
        assert done.stdout.split() == [level.name, avx512, avx512, "True"]


# The int8 GEMMs' innermost helpers (vnni_register_blocks.h, vnni_epilogue.h, vnni_layouts.h; avx2_gemm.h,
# avx2_layouts.h). Built out of line, even at one call site, their operands go through memory every step: GCC 12 did
# that to the step of a group's dot products and to Codes<6>::load and SuperScales::scale, and SmolLM2's 4-bit GEMMs
# at 512 rows made 101 G multiply-adds a second on one thread, not 152.
HOT_HELPERS = re.compile(r"cpuserve_vnni::(step_dots|group_sums|group_terms|channel_terms|weight_group_terms"
                         r"|activation_group_terms|zero_term|store|tile_group_sums|store_tile_sums)<"
                         r"|Gemm<.*>::(step|sums|group_sums|group_terms|channel_terms|zero_term)<"
                         r"|cpuserve_(vnni|avx2)::(Codes<\d+>::load|(Stored|Super)Scales<[^<>]*>::\w+|dpbusd\w*"
                         r"|broadcast4|load8\w*|to_bf16)\(|cpuserve_simd::to_bf16_exact\(")


def test_the_gemms_loop_helpers_have_no_out_of_line_copy():
    if not native.vnni_gemm_enabled():
        pytest.skip("the int8 GEMMs are not built on this CPU (neither AVX-512 VNNI nor AVX2)")
    nm = shutil.which("nm")
    assert nm, "nm (binutils, which the kernels' build links with) not found"
    symbols = subprocess.run([nm, "-C", "--defined-only", str(native.library_path())], check=True,
                             capture_output=True, text=True).stdout.splitlines()
    assert any("vnni_gemm" in s for s in symbols), "the symbol table holds no GEMM at all: the wrong library?"
    out_of_line = [s for s in symbols if HOT_HELPERS.search(s)]
    assert not out_of_line, "GEMM loop helpers built out of line:\n" + "\n".join(out_of_line[:10])
