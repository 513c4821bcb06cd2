"""The CPU-dependent paths of the C++ kernels (engine/csrc), and which of them this pytest process ran.

Which path a kernel takes depends on the CPU: AMX (Intel Xeon Sapphire Rapids and later) or AVX512-BF16 alone (AMD
Zen 4), AVX2 without AVX-512, so one machine's test run checks only some of them. The int8 GEMMs of the lower
levels run in processes of their own (test_kernel_levels.py notes them). tests/engine/conftest.py prints the paths this run did
not take at the end of the suite, with the reason. SlimAttention counts its own calls by path (slim_attention_runs);
the int8 GEMMs' AMX paths are noted by the tests that check them (test_amx_gemm.py calls `note`), or seen in their
count of tile blocks.
"""

from __future__ import annotations

import sys

PATHS = {  # key -> what it is
    "slim_brgemm": "SlimAttention's bf16 products on oneDNN's brgemm (AMX-BF16; slim_attention.cpp)",
    "slim_avx512_bf16": "SlimAttention's bf16 products on AVX512-BF16 (bf16_dot.h)",
    "slim_int8_scores": "SlimAttention's Q K^T as int8 dot products (int8_scores.h, AVX-512 VNNI)",
    "slim_fp32": "SlimAttention's fp32 products (slim_attention_fp32.cpp, AVX-512)",
    "amx_tiles_hw": "the int8 GEMMs' AMX tiles, the instructions (amx_tiles.h AmxHw)",
    "amx_tiles_model": "the int8 GEMMs' AMX tiles, their software model (amx_tiles.h AmxEmu)",
    "int8_gemm_avx512_vnni": "the int8 GEMMs on AVX-512 VNNI (vnni_gemm.cpp)",
    "int8_gemm_avx_vnni": "the int8 GEMMs on AVX-VNNI (avx2_gemm.h, the avx2_vnni level)",
    "int8_gemm_avx2": "the int8 GEMMs on AVX2 (avx2_gemm.h, vpmaddubsw: the avx2 level)",
}
SLIM_RUNS = ("slim_brgemm", "slim_avx512_bf16", "slim_int8_scores", "slim_fp32")  # the order of slim_attention_runs()
_noted: set[str] = set()


def note(path: str) -> None:
    """A test saw `path` run (and checked it)."""
    assert path in PATHS, path
    _noted.add(path)


def not_run() -> list[str] | None:
    """'what: why' for each path this process did not run; None when no engine kernel was loaded here at all."""
    native = sys.modules.get("cpuserve.engine.layers.native")
    if native is None or not native.enabled.cache_info().currsize:
        return None  # no engine test asked for the kernels
    if not native.enabled():
        return ["every C++ kernel: they are not built or not enabled here (CPUSERVE_KERNELS); the plain-torch "
                "references ran instead"]
    import torch

    ops = torch.ops.cpuserve
    ran = set(_noted) | {name for name, count in zip(SLIM_RUNS, ops.slim_attention_runs()) if count}
    if ops.vnni_gemm_supported() and ops.vnni_gemm_amx_blocks() and "amx_tiles_model" not in _noted:
        ran.add("amx_tiles_hw")  # the engine's own mode is "hw" or "off": the model runs only where a test notes it
    if ops.vnni_gemm_supported() and ops.vnni_gemm_runs():
        ran.add(f"int8_gemm_{ops.vnni_gemm_isa()}")
    missing = []
    for path, what in PATHS.items():
        if path not in ran:
            missing.append(f"{what}: {_why(path, ops)}")
    return missing


def _why(path: str, ops) -> str:
    if path == "slim_brgemm" and not _can(ops.slim_attention_products, "brgemm"):
        return "torch offers no bf16 brgemm on this CPU (it needs AMX)"
    if path in ("slim_avx512_bf16", "slim_int8_scores") and not _can(ops.slim_attention_products, "avx512_bf16"):
        return "this CPU (or this build) has no AVX512-BF16"
    if path == "slim_int8_scores" and not _int8_scores_possible(ops):
        return "this CPU has no AVX-512 VNNI"
    if path == "slim_fp32" and not ops.slim_attention_fp32():
        return "this kernel level has no AVX-512"
    if path.startswith("amx_tiles") and ops.vnni_gemm_isa() != "avx512_vnni":
        return "the int8 GEMMs of this level have no AMX path (it is the AVX-512 level's)"
    if path.startswith("int8_gemm_"):
        return "this CPU runs no such level, or test_kernel_levels.py's forced runs did not run"
    if path == "amx_tiles_hw" and not _can(ops.vnni_gemm_amx, "auto", "hw"):
        return "this CPU has no AMX, or Linux did not grant the tile state"
    return "no test in this run took this path"


def _can(switch, mode: str, want: str | None = None) -> bool:
    """switch(mode) succeeds (and returns want, when given); the switch's previous mode is put back."""
    before = switch("")
    try:
        got = switch(mode)
        return want is None or got == want
    except RuntimeError:
        return False
    finally:
        switch({"hw": "auto"}.get(before, before))


def _int8_scores_possible(ops) -> bool:
    before = ops.slim_attention_products("")
    try:
        ops.slim_attention_products("avx512_bf16")
        return bool(ops.slim_attention_int8_keys())
    finally:
        ops.slim_attention_products(before)
