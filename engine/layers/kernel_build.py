"""The C++ kernels of engine/csrc, built as one shared library per x86 level; the engine loads the best one the
CPU runs (engine/layers/native.py), as llama.cpp's GGML_CPU_ALL_VARIANTS and oneDNN's cpu_isa dispatch do.

    level         -march                 runs on (every /proc/cpuinfo flag of the level present)
    avx512_bf16   x86-64-v4 +VNNI +BF16  Cooper Lake, Sapphire Rapids and later, Zen 4 and later
    avx512_vnni   x86-64-v4 +VNNI        Cascade Lake, Ice Lake (no BF16: SlimAttention's products fall back)
    avx2_vnni     x86-64-v3 +AVX-VNNI    Alder Lake and later cores without AVX-512, Sierra Forest
    avx2          x86-64-v3              Haswell to Skylake, Zen 2 and 3

AMX needs no level of its own: the int8 GEMMs' tiles are inline assembly, used only where CPUID and Linux grant
them at run time (amx_tiles.h), and SlimAttention's AMX path is torch's brgemm, dispatched by torch; so the
avx512_bf16 library is the Sapphire Rapids one. The AVX2 levels run the int8 GEMMs of avx2_gemm.h (the same
bits as the AVX-512 ones) and the other kernels' portable paths; SlimAttention there is torch's (attention.py).

Where the libraries come from:
    a wheel     every level is compiled when the wheel is built (setup.py) into cpuserve/engine/kernels/
    a checkout  (editable install, or an edited kernel) the CPU's level is compiled on first use, with progress
                on the terminal, into ~/.cache/cpuserve/kernels ($CPUSERVE_KERNEL_CACHE)
A library's file name carries a hash of everything that went into it (the sources, the flags, torch's version),
never the checkout's path, so another checkout of the same sources finds it; each source's object file is cached
the same way, by the source and the headers it includes, so editing one kernel recompiles only the files that include
it. A level that adds an instruction set to the one below it (avx512_bf16: AVX512-BF16; avx2_vnni: AVX-VNNI) compiles
with it only the sources that test its macro (in themselves or a header they include); every other object is the
level below's, compiled once for both.

No torch import at module level: setup.py loads this file before the package exists.
"""
from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

CSRC = Path(__file__).resolve().parent.parent / "csrc"
PREBUILT = Path(__file__).resolve().parent.parent / "kernels"  # in a wheel: the levels built ahead of time
# -fassociative-math lets GCC vectorize the reductions; with alignment peeling off, their summation order depends
# only on the length, never on where a buffer happens to sit: results are reproducible across processes and
# batch layouts (a replica group's ranks must match one rank bit for bit).
COMMON_FLAGS = ("-O3", "-std=c++20", "-fPIC", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno",
                "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
                "--param=vect-max-peeling-for-alignment=0")
_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})  # x86-64-v3
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}  # x86-64-v4


@dataclass(frozen=True)
class Level:
    """One build of the kernels: its compiler flags and the CPU flags (/proc/cpuinfo's names) it needs."""

    name: str
    flags: tuple[str, ...]  # every source's
    cpu_flags: frozenset[str]
    int8_isa: str  # the instructions its int8 GEMMs run on (torch.ops.cpuserve.vnni_gemm_isa)
    extra_flags: tuple[str, ...] = ()  # only the sources that test `macro`: the others are the level below's objects
    macro: str = ""  # the macro extra_flags define (the code that uses their instructions tests it)


_V4_VNNI = ("-march=x86-64-v4", "-mavx512vnni")
LEVELS = (  # best first
    Level("avx512_bf16", _V4_VNNI, _V4 | {"avx512_vnni", "avx512_bf16"}, "avx512_vnni",
          extra_flags=("-mavx512bf16",), macro="__AVX512BF16__"),
    Level("avx512_vnni", _V4_VNNI, _V4 | {"avx512_vnni"}, "avx512_vnni"),
    Level("avx2_vnni", ("-march=x86-64-v3",), _V3 | {"avx_vnni"}, "avx_vnni",
          extra_flags=("-mavxvnni",), macro="__AVXVNNI__"),
    Level("avx2", ("-march=x86-64-v3",), _V3, "avx2"),
)
LEVEL_NAMES = tuple(level.name for level in LEVELS)


def level_named(name: str) -> Level:
    for level in LEVELS:
        if level.name == name:
            return level
    raise ValueError(f"kernel level {name!r}: the levels are {', '.join(LEVEL_NAMES)}")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags as Linux names them (empty where /proc/cpuinfo is unreadable)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def runnable_levels(flags: frozenset[str]) -> list[Level]:
    """The levels a CPU with these flags runs, best first."""
    return [level for level in LEVELS if level.cpu_flags <= flags]


@functools.cache
def _settings():
    """engine/settings.py (the CPUSERVE_* variables). setup.py runs this file alone, before cpuserve is a package:
    there it is loaded from its path."""
    try:
        from cpuserve.engine import settings

        return settings
    except ModuleNotFoundError:
        spec = importlib.util.spec_from_file_location("cpuserve_settings", Path(__file__).parent.parent / "settings.py")
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up
        spec.loader.exec_module(module)
        return module


def mode() -> str:
    """CPUSERVE_KERNELS (engine/layers/native.py)."""
    return _settings().KERNELS.get()


def select_level(flags: frozenset[str] | None = None, forced: str | None = None) -> Level:
    """The level to load: CPUSERVE_KERNEL_LEVEL when set (and the CPU runs it), else the best the CPU runs.

    Raises:
        RuntimeError: the CPU runs no level, or not the one asked for (naming the flags it lacks).
    """
    flags = cpu_flags() if flags is None else flags
    forced = _settings().KERNEL_LEVEL.get() if forced is None else forced
    if forced:
        chosen = level_named(forced)
        if missing := sorted(chosen.cpu_flags - flags):
            raise RuntimeError(f"CPUSERVE_KERNEL_LEVEL={forced}: this CPU lacks {', '.join(missing)}; it runs "
                               f"{', '.join(l.name for l in runnable_levels(flags)) or 'no level'}")
        return chosen
    levels = runnable_levels(flags)
    if not levels:
        raise RuntimeError(f"this CPU runs none of the kernel levels ({', '.join(LEVEL_NAMES)})")
    return levels[0]


@functools.lru_cache(maxsize=1)
def level() -> Level:
    """The level of the library this process loads (decided once)."""
    return select_level()


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def headers() -> list[Path]:
    return sorted(CSRC.glob("*.h"))


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def included(source: Path) -> list[Path]:
    """source and every header of its folder it includes, transitively (an include inside an #if counts too)."""
    seen: list[Path] = []
    todo = [source]
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.append(path)
        todo += [path.parent / name for name in _LOCAL_INCLUDE.findall(path.read_text())]
    return seen


def _torch_version() -> str:
    """torch's version, read without importing it (a second or two saved where nothing is built)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        import torch

        return torch.__version__


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()[:16]


def _flags(level: Level, source: Path | None = None) -> tuple[str, ...]:
    """The compiler flags of one source of `level` (source None: every flag any of its sources gets)."""
    uses_extra = source is None or any(level.macro in p.read_text() for p in included(source))
    return (*COMMON_FLAGS, *level.flags, *(level.extra_flags if level.extra_flags and uses_extra else ()))


def object_name(level: Level, source: Path, toolchain: tuple[bytes, ...]) -> str:
    """The cached object file of `source` built for `level`: named by what goes into it (the source, the headers it
    includes, its flags, torch's and the compiler's versions), so levels and checkouts that agree share it."""
    code = [p.name.encode() + b"\0" + p.read_bytes() for p in included(source)]
    return f"{source.stem}_{_digest(*code, ' '.join(_flags(level, source)).encode(), *toolchain)}.o"


def library_name(level: Level) -> str:
    """The file name of `level`'s library for these sources, flags and torch: the same in every checkout."""
    code = [p.name.encode() + b"\0" + p.read_bytes() for p in sources() + headers()]
    return f"cpuserve_ops_{level.name}_{_digest(*code, ' '.join(_flags(level)).encode(), _torch_version().encode())}.so"


def cache_dir() -> Path:
    """Where a checkout's builds go: $CPUSERVE_KERNEL_CACHE, else ~/.cache/cpuserve/kernels."""
    if folder := _settings().KERNEL_CACHE.get():
        return Path(folder)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cpuserve" / "kernels"


def find_library(level: Level) -> Path | None:
    """The library of `level` built from these sources: the wheel's prebuilt one, else a cached build."""
    name = library_name(level)
    for folder in (PREBUILT, cache_dir()):
        if (folder / name).is_file():
            return folder / name
    return None


def _compile_command(level: Level, source: Path, out: Path) -> list[str]:
    import torch
    from torch.utils import cpp_extension

    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [a for path in cpp_extension.include_paths() for a in ("-isystem", path)]
    return [os.environ.get("CXX", "c++"), *_flags(level, source), abi, *includes, "-c", str(source), "-o", str(out)]


def _link_command(objects: list[Path], out: Path) -> list[str]:
    from torch.utils import cpp_extension

    libs = [f"-L{path}" for path in cpp_extension.library_paths()]
    return [os.environ.get("CXX", "c++"), "-shared", *map(str, objects), *libs, "-lc10", "-ltorch_cpu", "-ltorch",
            "-o", str(out)]


def _compiler_version() -> bytes:
    return subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, check=True).stdout


def build(level: Level, out_dir: Path, progress: Callable[[str], None] | None = None,
          jobs: int | None = None) -> Path:
    """Compiles `level`'s library into out_dir (a no-op when it is there) and returns its path.

    Object files are cached in cache_dir()/objects by a hash of their source, the headers it includes, the flags,
    torch's version and the compiler's (object_name), so only what changed is compiled again. One process builds a library at a time
    (a lock file in the cache); the others wait and then find it. progress gets one line per step.
    """
    say = progress or (lambda line: None)
    target = out_dir / library_name(level)
    out_dir.mkdir(parents=True, exist_ok=True)
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies: no stale lock
        if target.is_file():
            return target
        objects_dir = cache_dir() / "objects"
        objects_dir.mkdir(parents=True, exist_ok=True)
        toolchain = (_torch_version().encode(), _compiler_version())
        objects = {src: objects_dir / object_name(level, src, toolchain) for src in sources()}
        # the largest first: vnni_gemm.cpp takes half the build, and the others fill the other cores meanwhile
        todo = sorted((src for src, obj in objects.items() if not obj.is_file()), key=lambda p: -p.stat().st_size)
        jobs = jobs or len(os.sched_getaffinity(0))
        start = time.monotonic()
        say(f"compiling cpuserve's kernels for {level.name} CPUs: {len(todo)} of {len(objects)} sources "
            f"({len(objects) - len(todo)} cached) on {jobs} threads, into {out_dir}")

        def compile_one(src: Path) -> str:
            began = time.monotonic()
            part = objects[src].with_suffix(f".{os.getpid()}.tmp")
            done = subprocess.run(_compile_command(level, src, part), capture_output=True, text=True)
            if done.returncode != 0:
                part.unlink(missing_ok=True)
                raise RuntimeError(f"compiling {src} for {level.name} failed:\n{done.stderr[-4000:]}")
            part.replace(objects[src])
            return f"{src.name} ({time.monotonic() - began:.0f} s)"

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for i, done in enumerate(as_completed([pool.submit(compile_one, src) for src in todo]), 1):
                say(f"  [{i}/{len(todo)}] {done.result()}, {time.monotonic() - start:.0f} s so far")
        part = target.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run(_link_command(list(objects.values()), part), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"linking {target.name} failed:\n{done.stderr[-4000:]}")
        part.replace(target)
        say(f"built {target} in {time.monotonic() - start:.0f} s")
        return target


def print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def prepare() -> str | None:
    """Builds this CPU's library now if it must be built (a checkout's), with progress on this terminal, so that
    the processes started next (serving replicas, ranks) load it at once; loads nothing and imports no torch when
    it is there. Returns the level's name, or None where the mode or the CPU uses no kernels.

    Raises:
        RuntimeError: CPUSERVE_KERNELS=native and the library cannot be had.
    """
    if mode() == "torch":
        return None
    try:
        chosen = level()
        if find_library(chosen) is None:
            build(chosen, cache_dir(), progress=print_progress)
    except Exception as e:  # no level for this CPU, no compiler, a read-only cache ...
        if mode() == "native":
            raise RuntimeError(f"CPUSERVE_KERNELS=native but the kernels in {CSRC} cannot be loaded: {e}") from e
        print_progress(f"cpuserve: no fused CPU kernels ({e}); the engine runs its plain-torch path")
        return None
    return chosen.name


def main(argv: list[str] | None = None) -> int:
    """`python -m cpuserve.engine.layers.kernel_build [--level NAME | --all] [--out DIR]`."""
    parser = argparse.ArgumentParser(prog="python -m cpuserve.engine.layers.kernel_build",
                                     description="Compile the C++ kernels of engine/csrc ahead of their first use.")
    parser.add_argument("--level", choices=LEVEL_NAMES, action="append",
                        help="a level to build (repeatable; default: the best this CPU runs)")
    parser.add_argument("--all", action="store_true", help="every level")
    parser.add_argument("--out", type=Path, default=None, help="folder of the libraries (default: the cache)")
    args = parser.parse_args(argv)
    if args.all:
        levels = list(LEVELS)
    elif args.level:
        levels = [level_named(name) for name in args.level]
    else:
        levels = runnable_levels(cpu_flags())[:1]
        if not levels:
            print("this CPU runs none of the kernel levels "
                  f"({', '.join(LEVEL_NAMES)}): the engine uses its plain-torch path", file=sys.stderr)
            return 0
    for each in levels:
        out = args.out or cache_dir()
        ready = (out / library_name(each)).is_file()
        path = build(each, out, progress=print_progress)
        if ready:
            print_progress(f"cpuserve's kernels for {each.name} CPUs are built: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
