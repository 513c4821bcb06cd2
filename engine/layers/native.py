"""The fused C++ kernels of engine/csrc (torch.ops.cpuserve.*): the library of the best x86 level this CPU runs.

    CPUSERVE_KERNELS=auto    (default) use them when they load, else the plain-torch path with one warning
    CPUSERVE_KERNELS=native  fail if they do not load
    CPUSERVE_KERNELS=torch   never use them (the reference path)
    CPUSERVE_KERNEL_LEVEL=<level>   a lower level than the CPU's best (the tests run each level so); a level the
                                    CPU lacks is refused by name

A wheel carries every level's library, built when the wheel was (engine/layers/kernel_build.py has the levels);
a checkout compiles its level on first use into ~/.cache/cpuserve/kernels, saying so on the terminal (about
3 minutes on 2 cores; an edited kernel recompiles only its own file).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from cpuserve.engine import settings
from cpuserve.engine.layers import kernel_build
from cpuserve.engine.layers.kernel_build import level, mode, select_level  # noqa: F401 (this module's API)

log = logging.getLogger(__name__)
MODES = settings.KERNELS.choices


def library_path() -> Path:
    """Where this level's library for these sources lies: the wheel's, else the cache's (built there if missing)."""
    return kernel_build.find_library(level()) or kernel_build.cache_dir() / kernel_build.library_name(level())


@functools.lru_cache(maxsize=1)
def _load() -> bool:
    path = kernel_build.find_library(level())
    if path is None:  # a checkout (or an edited kernel): the developer path, with progress on the terminal
        path = kernel_build.build(level(), kernel_build.cache_dir(), progress=kernel_build.print_progress)
    torch.ops.load_library(str(path))
    log.info("cpuserve kernels: %s (%s)", level().name, path)
    return True


def available() -> bool:
    """True when torch.ops.cpuserve.* are loaded and the mode allows them (builds them on first call)."""
    m = mode()
    if m == "torch":
        return False
    settings.AMX.get()  # read by the C++ GEMMs (amx_mode, bf16_mode), which take any value but off as auto
    try:
        return _load()
    except Exception as e:  # no level for this CPU, no compiler, a read-only cache ...
        if m == "native":
            raise RuntimeError(f"CPUSERVE_KERNELS=native but the kernels in {kernel_build.CSRC} did not load: {e}") \
                from e
        _warn_once(e)
        return False


@functools.lru_cache(maxsize=1)
def enabled() -> bool:
    """available(), decided once per process: what the model's layers consult on every call."""
    return available()


@functools.lru_cache(maxsize=1)
def slim_attention_native_enabled() -> bool:
    """The C++ SlimAttention can run: its bf16 products have a kernel on this CPU (oneDNN's brgemm with AMX, or
    our AVX512-BF16 one; torch.ops.cpuserve.slim_attention_kernel() names it)."""
    return enabled() and bool(torch.ops.cpuserve.slim_attention_kernel())


@functools.lru_cache(maxsize=1)
def slim_attention_fp32_enabled() -> bool:
    """The C++ SlimAttention takes fp32 q, k and v (slim_attention_fp32.cpp: fp32 products on AVX-512, each row's bits
    independent of how its prompt was split); elsewhere fp32 prefill runs attention.py's plain-torch path."""
    return enabled() and bool(torch.ops.cpuserve.slim_attention_fp32())


@functools.lru_cache(maxsize=1)
def slim_attention_int8_keys() -> bool:
    """The C++ SlimAttention takes an int8 K (Q K^T as int8 dot products): its products run on avx512_bf16 and the
    CPU has AVX-512 VNNI. Where AMX's bf16 brgemm runs, it does not (that is faster than VNNI's int8)."""
    return slim_attention_native_enabled() and bool(torch.ops.cpuserve.slim_attention_int8_keys())


@functools.lru_cache(maxsize=1)
def int4_gemm_enabled() -> bool:
    """Our int4 GEMM can run and reproduces torch's int4 kernel exactly on this CPU (checked once, both the
    few-row and the tiled path)."""
    if not (enabled() and torch.ops.cpuserve.int4_gemm_supported()):
        return False
    gen = torch.Generator().manual_seed(0)
    for n in (576, 80):  # whole 64-column blocks, halves and a 16-column tail (the other packing)
        k, group = 128, 32
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        sz = torch.stack([torch.rand(k // group, n, generator=gen) / 8, torch.randn(k // group, n, generator=gen) / 8],
                         -1).to(torch.bfloat16)
        for rows in (3, 40):  # registers (int4_few_rows.cpp), then the tile
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz).float()
            got = torch.ops.cpuserve.int4_gemm(x, packed, group, sz).float()
            if not torch.equal(got, want):  # the same arithmetic as torch's kernel: bit for bit
                log.warning("int4 GEMM kernel disagrees with torch's int4 packing on this CPU (N=%d, %d rows, max "
                            "diff %.3g); using torch's kernel for every batch size", n, rows, (got - want).abs().max())
                return False
    return True


@functools.lru_cache(maxsize=1)
def int8_gemm_enabled() -> bool:
    """Our int8 GEMM can run and reproduces torch's int8 kernel exactly on this CPU (checked once)."""
    if not (enabled() and torch.ops.cpuserve.int8_gemm_supported()):
        return False
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (80, 96), generator=gen, dtype=torch.int8)
    scales = (torch.rand(80, generator=gen) / 64).to(torch.bfloat16)
    for rows in (5, 40):
        x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
        if not torch.equal(torch.ops.cpuserve.int8_gemm(x, w, scales), torch._weight_int8pack_mm(x, w, scales)):
            log.warning("int8 GEMM kernel disagrees with torch's int8 kernel on this CPU; using torch's kernel")
            return False
    return True


@functools.lru_cache(maxsize=1)
def dense_gemm_enabled() -> bool:
    """Our fp32 / bf16 GEMM (dense_gemm.cpp: each row's bits independent of the batch) runs here: the kernels are
    built, on AVX2 or AVX-512 (torch.ops.cpuserve.dense_gemm_isa() names which)."""
    return enabled() and bool(torch.ops.cpuserve.dense_gemm_supported())


@functools.lru_cache(maxsize=1)
def vnni_gemm_enabled() -> bool:
    """The int8 dot-product GEMMs are built for this CPU: AVX-512 VNNI (vnni_gemm.cpp) or AVX2 (avx2_gemm.h, the
    same bits; vnni_gemm_isa() names which). Where the CPU has AMX, the AVX-512 build's tile path is kept only if it
    gives the register blocks' bits on a probe (checked once)."""
    if not (enabled() and torch.ops.cpuserve.vnni_gemm_supported()):
        return False
    if torch.ops.cpuserve.vnni_gemm_amx("") == "hw" and not amx_reproduces_registers("auto"):
        torch.ops.cpuserve.vnni_gemm_amx("off")
    return True


def vnni_gemm_isa() -> str:
    """The instructions the int8 dot-product GEMMs run on here: "avx512_vnni" (and AMX tiles where vnni_gemm_amx says
    so), "avx_vnni" or "avx2"; "" where they do not run (the layers then keep bf16 activations)."""
    return str(torch.ops.cpuserve.vnni_gemm_isa()) if vnni_gemm_enabled() else ""


def amx_reproduces_registers(mode: str) -> bool:
    """The tile path in `mode` ("auto": the instructions, "emulate": their model) gives the register blocks' bits on
    a probe of 4- and 8-bit codes; the mode stays set."""
    gen = torch.Generator().manual_seed(0)
    n, k = 48, 128  # a tile of two column blocks and one of one
    for bits, group in ((4, 32), (8, 64)):
        packed = torch.randint(0, 256, (n // 16, k * bits // 32, 64), generator=gen, dtype=torch.uint8)
        scales = torch.rand(n // 16, k // group, 16, generator=gen) / 64
        zoffs = torch.randn(n // 16, k // group, 16, generator=gen) / 64
        x = torch.randn(136, k, generator=gen).to(torch.bfloat16)  # tiles from 128 rows (vnni_column_tiles.h)
        torch.ops.cpuserve.vnni_gemm_amx("off")
        want = torch.ops.cpuserve.vnni_gemm(x, packed, scales, zoffs, bits, group)
        torch.ops.cpuserve.vnni_gemm_amx(mode)
        got = torch.ops.cpuserve.vnni_gemm(x, packed, scales, zoffs, bits, group)
        if not torch.equal(got, want):
            log.warning("the int8 GEMMs' AMX tiles disagree with their register blocks on this CPU (%d-bit codes, "
                        "groups of %d, max diff %.3g); using the register blocks", bits, group,
                        (got.float() - want.float()).abs().max())
            return False
    return True


def amx_bf16_gemm_enabled() -> bool:
    """The prompt rows' GEMM (AMX-BF16 tiles over the int8-activation layers' codes: act_int8.py) is chosen and can
    run: CPUSERVE_PROMPT_GEMM=bf16 (the default), the kernels built, the CPU with AMX-BF16 and CPUSERVE_AMX not off
    (which the C++ side honours). Asked live, not cached: torch.ops.cpuserve.amx_bf16_gemm_mode switches it at run
    time (tests)."""
    if prompt_gemm() != "bf16":
        return False
    return enabled() and hasattr(torch.ops.cpuserve, "amx_bf16_gemm_supported") and bool(
        torch.ops.cpuserve.amx_bf16_gemm_supported())


PROMPT_GEMMS = settings.PROMPT_GEMM.choices


def prompt_gemm() -> str:
    """CPUSERVE_PROMPT_GEMM: the prompt rows' scheme, bf16 (the default: AMX-BF16 tiles where the CPU has them, else
    the int8 scheme) or int8 (every row the same scheme)."""
    return settings.PROMPT_GEMM.get()


@functools.lru_cache(maxsize=1)
def _warn_once(error: Exception) -> None:
    log.warning("fused CPU kernels unavailable (%s); using the plain-torch path, which is slower at small "
                "batches. Set CPUSERVE_KERNELS=torch to silence this.", error)
