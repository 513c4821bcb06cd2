"""The int8-activation path (the engine's default) at every kernel level this CPU runs (engine/layers/kernel_build.py):
the level this process loaded, and each other one forced (CPUSERVE_KERNEL_LEVEL) in a process of its own, so that
a machine with AVX-512 also checks the AVX2 levels' kernels (avx2_gemm.h) and none skips the default path.

    every other level   its GEMMs give this process's bits (level_gemms.py's cases: every weight form, register
                        block, remainder and tile path), and the model's layers run that level's own GEMMs (counted
                        in its library, not read from a config)
    the lowest level    the int8 tests too (INT8_TESTS, none skipped): every kernel of its library differs from an
                        AVX-512 level's (avx2_gemm.h's GEMMs, the other kernels' portable paths)

The levels in between are not run through INT8_TESTS again (2 minutes each on 2 cores): each differs from a level
run in full only in objects whose outputs the bits test compares. avx2_vnni's library is avx2's objects but for
vnni_gemm.cpp (the GEMMs on vpdpbusd), avx512_vnni's is avx512_bf16's but for SlimAttention and the AMX-BF16 prompt
kernel (test_native_kernels.py checks which objects each pair shares).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kernel_paths
import level_gemms
import pytest
import torch

from cpuserve.engine.layers import kernel_build, native
from cpuserve.engine.layers.linear.act_int8 import Int8ActLinear
from cpuserve.engine.layers.linear.base import QuantLinear
from cpuserve.engine.layers.linear.stacked import StackedLinear
from cpuserve.engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
# The int8 GEMMs against their references and bounds, the model paths over them, and whole models on the engine's
# defaults against Hugging Face transformers (every architecture's tiny model; a Q4_K_M, a Q4_0 file and quantized
# checkpoints keeping their codes), each level's other kernels (attention, norms: the AVX2 levels' portable ones)
# included: what every level must pass with no test skipped. (The AMX tiles' own tests, test_amx_gemm.py and
# test_amx_bf16_gemm.py, belong to the AVX-512 level, which this process or its forced run covers.)
INT8_TESTS = ("test_int8_activations.py", "test_super_scales.py", "test_int8_token.py", "test_gguf_codes.py",
              "test_stacked_linear.py", "test_fused_decode.py", "test_int8_token_archs.py",
              "test_kquant_models.py::test_q4_k_m_default_engine_keeps_the_files_codes",
              "test_gemma3.py::test_q4_0_file_on_the_default_engine",
              "test_quantized_checkpoints.py::test_default_engine_keeps_the_checkpoints_codes",
              "test_kernel_levels.py::test_the_layers_run_this_levels_int8_kernels")
LEVEL_TIMEOUT_S = 1800  # a forced level's run, its library's first build included (minutes on 2 cores)


def other_levels() -> list[kernel_build.Level]:
    """The levels this CPU runs besides the one this process loaded."""
    return [lv for lv in kernel_build.runnable_levels(kernel_build.cpu_flags()) if lv.name != native.level().name]


def forced(level: kernel_build.Level) -> dict[str, str]:
    return {**os.environ, "CPUSERVE_KERNEL_LEVEL": level.name, "CPUSERVE_KERNELS": "native"}


def int8_layers(model) -> list[QuantLinear]:
    """Every linear layer of the decoder, a StackedLinear's parts each."""
    layers = [m for m in model.layers.modules() if isinstance(m, QuantLinear)]
    return [p for m in layers for p in (m.parts if isinstance(m, StackedLinear) else [m])]


def test_the_layers_run_this_levels_int8_kernels(llm_int4):
    """The default model's layers are built for int8 activations and their GEMMs run in this level's library, on its
    instructions: counted there (vnni_gemm_runs), not read from the config."""
    want = native.level().int8_isa
    assert native.vnni_gemm_isa() == want
    assert native.library_path().name.startswith(f"cpuserve_ops_{native.level().name}_")
    layers = int8_layers(llm_int4.engine.runner.model)
    assert layers and all(isinstance(m, Int8ActLinear) for m in layers), \
        f"layers without int8 activations: {[type(m).__name__ for m in layers if not isinstance(m, Int8ActLinear)]}"
    # prompt rows take AMX-BF16 tiles where the AVX-512 level has them (amx_bf16_gemm.cpp), else the int8 GEMMs too
    prompt_kernel = native.amx_bf16_gemm_enabled()
    assert all(m.has_prompt_kernel() == prompt_kernel for m in layers)
    if want != "avx512_vnni":
        assert not prompt_kernel and torch.ops.cpuserve.vnni_gemm_amx("") == "off"  # the AVX-512 build's tiles
    before = torch.ops.cpuserve.vnni_gemm_runs()
    steps = 4  # a prefill and three decode steps, each through every layer
    llm_int4.generate(["The int8 GEMMs of this level"], SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    assert torch.ops.cpuserve.vnni_gemm_runs() - before >= (steps - prompt_kernel) * len(layers)


def run_tests_at(level: kernel_build.Level, tests: list[str]) -> None:
    """tests (of tests/engine) in a pytest process of their own at `level`: all pass, none skipped."""
    files = [str(ROOT / "tests" / "engine" / name) for name in tests]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *files],
                          env=forced(level), cwd=ROOT, capture_output=True, text=True, timeout=LEVEL_TIMEOUT_S)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, f"{level.name}: {summary}\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, f"{level.name}: {summary}"
    kernel_paths.note(f"int8_gemm_{level.int8_isa}")


@pytest.mark.slow
def test_the_int8_tests_pass_at_the_lowest_level():
    """INT8_TESTS under the lowest level this CPU runs (its library built first if need be), none skipped."""
    lowest = kernel_build.runnable_levels(kernel_build.cpu_flags())[-1]
    if lowest.name == native.level().name:
        pytest.skip(f"this process runs the lowest level ({lowest.name}): the suite itself is its run")
    run_tests_at(lowest, list(INT8_TESTS))


@pytest.mark.slow
def test_the_layers_run_each_other_levels_int8_kernels():
    """The layers test, under each other level but the lowest (whose INT8_TESTS hold it)."""
    lowest = kernel_build.runnable_levels(kernel_build.cpu_flags())[-1]
    between = [level for level in other_levels() if level != lowest]
    if not between:
        pytest.skip("this CPU runs no level besides this process's and the lowest")
    for level in between:
        run_tests_at(level, ["test_kernel_levels.py::test_the_layers_run_this_levels_int8_kernels"])


@pytest.mark.slow
def test_every_level_gives_this_levels_bits(tmp_path):
    """level_gemms.py's cases (every weight form, rows through every register block, remainder and tile path) at
    each other level: the same bf16 outputs, bit for bit, as this process computes."""
    if not other_levels():
        pytest.skip("this CPU runs one kernel level only")
    here = level_gemms.outputs()
    for level in other_levels():
        out = tmp_path / f"{level.name}.pt"
        done = subprocess.run([sys.executable, str(ROOT / "tests" / "engine" / "level_gemms.py"), str(out)],
                              env=forced(level), cwd=ROOT, capture_output=True, text=True, timeout=LEVEL_TIMEOUT_S)
        assert done.returncode == 0, done.stderr[-3000:]
        there = torch.load(out)
        assert there.keys() == here.keys()
        differ = [k for k in here if not torch.equal(here[k], there[k])]
        assert not differ, f"{level.name} differs from {native.level().name} in {len(differ)} cases: {differ[:8]}"


# Per level, the instructions its CPUs may lack that no code path of its library may hold: for the AVX2 levels AVX-512
# (EVEX: 512-bit and mask registers, registers 16-31, embedded broadcasts) and AMX's tile instructions, and for avx2
# AVX-VNNI's vpdpbusd too; for avx512_vnni (Cascade Lake, Ice Lake) AVX512-BF16's. (The AVX-512 levels hold AMX tile
# instructions: amx_tiles.h runs them only where CPUID and Linux grant the tiles.)
AVX512_OR_AMX = r"%zmm|%k[0-7]\b|%[xy]mm(1[6-9]|2\d|3[01])\b|\{1to\d+\}|\b(ldtilecfg|tileloadd|tdp\w+)\b"
FOREIGN = {"avx2": re.compile(AVX512_OR_AMX + r"|\bvpdp(bu|ws)sd"), "avx2_vnni": re.compile(AVX512_OR_AMX),
           "avx512_vnni": re.compile(r"\bv(cvtne2?ps2bf16|dpbf16ps)\b")}


@pytest.mark.parametrize("name", sorted(FOREIGN))
@pytest.mark.slow
def test_a_levels_library_holds_no_instruction_its_cpus_lack(name):
    """Such a CPU would fault on one: every instruction of the level's library is disassembled."""
    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils, which the kernels' build links with) not found"
    library = kernel_build.build(kernel_build.level_named(name), kernel_build.cache_dir())  # a no-op once built
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(library)], check=True, capture_output=True,
                          text=True).stdout
    dot = {"avx2": "vpmaddubsw", "avx2_vnni": "vpdpbusd", "avx512_vnni": "vpdpbusd"}[name]
    assert re.search(rf"\b{dot}\b", text), f"{library.name}: no {dot}: not the int8 GEMMs of {name}"
    found = [line for line in text.splitlines() if FOREIGN[name].search(line)]
    assert not found, f"{library.name}: {len(found)} instructions its CPUs lack, e.g.\n" + "\n".join(found[:5])
