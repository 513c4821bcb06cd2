"""The int8-activation path (the engine's default) at every kernel level this CPU runs (engine/layers/kernel_build.py):
the level this process loaded, and each other one forced (CPUSERVE_KERNEL_LEVEL) in a process of its own, so that
a machine with AVX-512 also checks the AVX2 levels' kernels (avx2_gemm.h) and none skips the default path.

At each level the int8 tests pass (INT8_TESTS, run again under the forced level), the layers run that level's own
GEMMs (counted in the library, not read from a config), and the GEMMs give the very bits of this process's level.
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
# The instructions of each level's int8 GEMMs (torch.ops.cpuserve.vnni_gemm_isa)
LEVEL_ISA = {"avx512_bf16": "avx512_vnni", "avx512_vnni": "avx512_vnni", "avx2_vnni": "avx_vnni", "avx2": "avx2"}
# The int8 GEMMs against their references and bounds, and the model paths over them: what every level must pass
# with no test skipped. (The AMX tiles' own tests, test_amx_gemm.py and test_amx_bf16_gemm.py, belong to the
# AVX-512 level, which this process or its forced run covers.)
INT8_TESTS = ("test_int8_activations.py", "test_super_scales.py", "test_int8_token.py", "test_gguf_codes.py",
              "test_stacked_linear.py", "test_fused_decode.py",
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
    want = LEVEL_ISA[native.level().name]
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


@pytest.mark.slow
def test_the_int8_tests_pass_at_every_other_level():
    """INT8_TESTS under each other level (its library built first if need be), none skipped."""
    if not other_levels():
        pytest.skip("this CPU runs one kernel level only")
    for level in other_levels():
        files = [str(ROOT / "tests" / "engine" / name) for name in INT8_TESTS]
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *files],
                              env=forced(level), cwd=ROOT, capture_output=True, text=True, timeout=LEVEL_TIMEOUT_S)
        summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
        assert done.returncode == 0, f"{level.name}: {summary}\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
        assert re.search(r"\d+ passed", summary) and "skipped" not in summary, f"{level.name}: {summary}"
        kernel_paths.note(f"int8_gemm_{LEVEL_ISA[level.name]}")


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


# AVX-512 (EVEX) and AMX where an AVX2 CPU has neither: 512-bit and mask registers, registers 16-31, embedded
# broadcasts, tile instructions
FOREIGN = re.compile(r"%zmm|%k[0-7]\b|%[xy]mm(1[6-9]|2\d|3[01])\b|\{1to\d+\}|\b(ldtilecfg|tileloadd|tdp\w+)\b")


@pytest.mark.slow
def test_the_avx2_levels_libraries_hold_no_avx512_or_amx_instruction():
    """An AVX2 CPU would fault on one: every instruction of the AVX2 levels' libraries is disassembled."""
    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils, which the kernels' build links with) not found"
    for level in kernel_build.LEVELS:
        if "avx512f" in level.cpu_flags:
            continue
        library = kernel_build.build(level, kernel_build.cache_dir())  # a no-op once built
        text = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(library)], check=True, capture_output=True,
                              text=True).stdout
        assert "vpmaddubsw" in text or "vpdpbusd" in text, f"{library.name}: no int8 dot product at all"
        found = [line for line in text.splitlines() if FOREIGN.search(line)]
        assert not found, f"{library.name}: {len(found)} AVX-512 / AMX instructions, e.g.\n" + "\n".join(found[:5])
