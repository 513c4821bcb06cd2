"""The fused C++ kernels of engine/csrc (torch.ops.cpuserve.*), compiled on first use for this CPU.

    CPUSERVE_KERNELS=auto    (default) use them when they build, else the plain-torch path with one warning
    CPUSERVE_KERNELS=native  fail if they do not build
    CPUSERVE_KERNELS=torch   never use them (the reference path)

The build (-O3 -march=native, about 40 s on 2 cores) is cached under ~/.cache/cpuserve/kernels, keyed by the
source, torch's version and the CPU's feature flags, so a cache copied to another CPU model is not reused.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = [CSRC / name for name in ("decode_ops.cpp", "decode_attention.cpp", "slim_attention.cpp", "int4_gemm.cpp",
                                     "int4_few_rows.cpp", "int8_gemm.cpp", "vnni_gemm.cpp", "amx_bf16_gemm.cpp",
                                     "decode_layers.cpp", "argmax.cpp", "kv_gather.cpp")]
# headers are part of the build's cache key too
HEADERS = [CSRC / name for name in ("simd.h", "tasks.h", "int4_few_rows.h", "bf16_dot.h", "act_quant.h", "ops.h",
                                     "rows.h", "warm.h", "vnni_layouts.h", "int8_scores.h", "amx_tiles.h")]
# -fassociative-math lets GCC vectorize the reductions; with alignment peeling off, their summation order depends
# only on the length, never on where a buffer happens to sit: results are reproducible across processes and
# batch layouts (a replica group's ranks must match one rank bit for bit).
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
          "-fassociative-math", "-fno-signed-zeros", "--param=vect-max-peeling-for-alignment=0"]
MODES = ("auto", "native", "torch")


def mode() -> str:
    value = os.environ.get("CPUSERVE_KERNELS", "auto")
    if value not in MODES:
        raise ValueError(f"CPUSERVE_KERNELS={value!r}: allowed values are {', '.join(MODES)}")
    return value


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_name() -> str:
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.read_bytes())
    h.update(" ".join(CFLAGS).encode() + torch.__version__.encode() + _cpu_flags().encode())
    return f"cpuserve_ops_{h.hexdigest()[:12]}"


STALE_LOCK_SECONDS = 900  # a build takes ~40 s (minutes on a loaded machine): a lock this old outlived its build


def clear_stale_lock(build_dir: Path, max_age: float = STALE_LOCK_SECONDS) -> bool:
    """Remove the build lock torch's cpp_extension leaves behind when a compiling process is killed (every later
    start would wait on it forever); True if one was removed. A lock younger than max_age is a build in progress."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age:
        return False
    log.warning("removing %s: left %.0f s ago by a kernel build that did not finish", lock, age)
    lock.unlink(missing_ok=True)
    return True


def library_path() -> Path:
    """Where this source, torch and CPU's build of the kernels lies (or will lie once built)."""
    name = _build_name()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "cpuserve" / "kernels" / name / f"{name}.so"


@functools.lru_cache(maxsize=1)
def _load() -> bool:
    from torch.utils import cpp_extension

    name = _build_name()
    build_dir = library_path().parent
    build_dir.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(build_dir)
    if not library_path().exists():
        print(f"compiling cpuserve's CPU kernels for this CPU into {build_dir} (first use only, ~40 s)",
              file=sys.stderr, flush=True)
    cpp_extension.load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS,
                       build_directory=str(build_dir), is_python_module=False, verbose=False)
    return True


def available() -> bool:
    """True when torch.ops.cpuserve.* are loaded and the mode allows them (builds them on first call)."""
    m = mode()
    if m == "torch":
        return False
    try:
        return _load()
    except Exception as e:  # no compiler, no ninja, a read-only cache ...
        if m == "native":
            raise RuntimeError(f"CPUSERVE_KERNELS=native but the kernels in {CSRC} did not build: {e}") from e
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
def vnni_gemm_enabled() -> bool:
    """The int8 dot-product GEMMs (vnni_gemm.cpp) are built for this CPU (AVX-512 VNNI). Where the CPU has AMX,
    their tile path is kept only if it gives the register blocks' bits on a probe (checked once)."""
    if not (enabled() and torch.ops.cpuserve.vnni_gemm_supported()):
        return False
    if torch.ops.cpuserve.vnni_gemm_amx("") == "hw" and not amx_reproduces_registers("auto"):
        torch.ops.cpuserve.vnni_gemm_amx("off")
    return True


def amx_reproduces_registers(mode: str) -> bool:
    """The tile path in `mode` ("auto": the instructions, "emulate": their model) gives the register blocks' bits on
    a probe of 4- and 8-bit codes; the mode stays set."""
    gen = torch.Generator().manual_seed(0)
    n, k = 48, 128  # a tile of two column blocks and one of one
    for bits, group in ((4, 32), (8, 64)):
        packed = torch.randint(0, 256, (n // 16, k * bits // 32, 64), generator=gen, dtype=torch.uint8)
        scales = torch.rand(n // 16, k // group, 16, generator=gen) / 64
        zoffs = torch.randn(n // 16, k // group, 16, generator=gen) / 64
        x = torch.randn(136, k, generator=gen).to(torch.bfloat16)  # tiles from 128 rows (vnni_gemm.cpp)
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


@functools.lru_cache(maxsize=1)
def _warn_once(error: Exception) -> None:
    log.warning("fused CPU kernels unavailable (%s); using the plain-torch path, which is slower at small "
                "batches. Set CPUSERVE_KERNELS=torch to silence this.", error)
