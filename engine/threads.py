"""Thread binding: torch uses the cores of this process's own affinity mask, never the host's core count."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from pathlib import Path

from cpuserve.engine import settings


log = logging.getLogger(__name__)


def affinity_cores() -> list[int]:
    """The CPUs this process may run on; a container's cpuset (or taskset) is the truth."""
    return sorted(os.sched_getaffinity(0))


def configure_threads(num_threads: int | None = None) -> int:
    cores = affinity_cores()
    n = num_threads or len(cores)
    if n > len(cores):
        log.warning("num_threads=%d exceeds the %d cores in the affinity mask %s", n, len(cores), cores)
    import torch  # here: the `cpuserve` command imports this module before it re-executes itself

    torch.set_num_threads(n)
    log.info("torch threads=%d, affinity mask=%s", n, cores)
    return n


# glibc's mallopt parameters
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3


def _mallopt(*settings: tuple[int, int]) -> bool:
    """Apply glibc mallopt (param, value) settings in order; False if one fails or this is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, macOS): nothing to tune
        return False
    return all(libc.mallopt(param, value) for param, value in settings)


def tune_allocator() -> bool:
    """Keep freed multi-MB activations in the heap instead of returning them to the OS on every call.

    glibc's default mmap threshold makes each large temporary fresh zeroed pages; measured here a batch-8 decode
    attention went from 6.0 ms to 0.8 ms with these settings. Process-wide, so set once at engine start.
    """
    return _mallopt((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20))


def allocator_for_loading() -> bool:
    """Give the model load's large temporaries (fp32 weights, quantization passes) their own mmap'd pages, which go
    back to the OS when freed. glibc's default threshold rises after each such free, after which they pile up in
    the heap: SmolLM2's peak RSS while loading varied from 0.9 to 1.4 GB between runs, 0.76 GB with this.
    tune_allocator replaces the setting once loading is done."""
    return _mallopt((M_MMAP_THRESHOLD, 1 << 20))


def release_free_memory() -> None:
    """Hand the heap's free pages back to the OS (after loading: the fp32 copies of the weights are gone)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# -- OpenMP runtime ------------------------------------------------------------------------------------------
# torch ships GNU libgomp. Measured here, libgomp pays ~80 us per parallel region started from any thread but the
# process's first one, and AsyncLLMEngine (hence every serving replica) steps in its own thread: single-stream
# decode ran at 48 tok/s there against 104 on the main thread. Intel's OpenMP (PyPI `intel-openmp`, an x86
# dependency) keeps a warm team for every thread: preloaded, both run at ~108. It must be loaded before
# anything else, hence LD_PRELOAD: `cpuserve` re-executes itself with it, and serving passes it to the Ray
# workers it starts. CPUSERVE_OPENMP=gnu keeps torch's libgomp.

def intel_openmp_library() -> str | None:
    """Path of libiomp5.so installed into this environment (by the intel-openmp wheel), or None."""
    if settings.OPENMP.get() == "gnu":
        return None
    for prefix in (sys.prefix, sys.base_prefix):
        path = Path(prefix) / "lib" / "libiomp5.so"
        if path.is_file():
            return str(path)
    return None


def openmp_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables that make a new process load Intel's OpenMP first (empty if not installed)."""
    env = os.environ if env is None else env
    lib = intel_openmp_library()
    preload = env.get("LD_PRELOAD", "")
    if lib is None or lib in preload.split(":"):
        return {}
    return {"LD_PRELOAD": f"{lib}:{preload}" if preload else lib}


def reexec_with_intel_openmp() -> None:
    """Replace this process by itself with Intel's OpenMP preloaded; returns at once if that is done already,
    not installed, or turned off. Call first thing in a command-line entry point, before torch is imported."""
    extra = openmp_env()
    if not extra or settings.REEXEC.get():
        return
    env = {**os.environ, **extra, settings.REEXEC.name: settings.REEXEC.text(True)}
    log.debug("re-executing with %s", extra)
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)  # the command line as typed


def slow_openmp_warning() -> str | None:
    """What to tell a user whose process runs torch's libgomp although Intel's OpenMP is installed, or None.

    Only a process started with it preloaded gets it (`cpuserve` re-executes itself so; a Python program
    cannot switch once torch is loaded), so the engine says how."""
    if openmp_runtime() != "gnu" or intel_openmp_library() is None:
        return None
    return ("this process runs torch's GNU OpenMP (libgomp): decode is up to 2x slower than with Intel's OpenMP, "
            "which the cpuserve command uses. Put `from cpuserve.engine.threads import reexec_with_intel_openmp; "
            "reexec_with_intel_openmp()` first in your script, or start Python with LD_PRELOAD=" +
            intel_openmp_library() + " (CPUSERVE_OPENMP=gnu silences this)")


def openmp_runtime() -> str:
    """Which OpenMP runtime this process runs its parallel regions on: "intel" or "gnu"."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    return "intel" if "libiomp5" in maps else "gnu"
