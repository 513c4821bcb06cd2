"""Intel's OpenMP preload: what `cpuserve` re-executes with and serving gives its Ray workers (engine/threads.py)."""
import os
import subprocess
import sys

from cpuserve.engine.threads import intel_openmp_library, openmp_env

PROBE = ("import ctypes, torch; from cpuserve.engine.threads import openmp_runtime; "
         "torch.ones(1 << 20).exp().sum(); print(openmp_runtime())")


def run(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_intel_openmp_is_installed_by_the_project():
    # an x86 dependency in pyproject.toml; without it serving replicas step 2x slower (see threads.py)
    assert intel_openmp_library() is not None


def test_preload_env_makes_a_process_run_intel_openmp():
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CPUSERVE_OPENMP")}
    extra = openmp_env(base)
    assert extra["LD_PRELOAD"].endswith("libiomp5.so")
    assert run({**base, **extra}) == "intel"
    assert run(base) == "gnu"  # torch alone: its libgomp
    assert openmp_env({**base, **extra}) == {}  # already preloaded: nothing more to add
    assert openmp_env({**base, "LD_PRELOAD": "/x/libfoo.so"})["LD_PRELOAD"].endswith("libiomp5.so:/x/libfoo.so")


def test_gnu_keeps_torch_libgomp(monkeypatch):
    monkeypatch.setenv("CPUSERVE_OPENMP", "gnu")
    assert intel_openmp_library() is None and openmp_env({}) == {}


def test_cpuserve_command_reexecutes_with_intel_openmp():
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CPUSERVE_REEXEC", "CPUSERVE_OPENMP")}
    code = ("import sys, os; from cpuserve.engine.threads import reexec_with_intel_openmp; "
            "reexec_with_intel_openmp(); print(os.environ.get('LD_PRELOAD', ''))")
    out = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("libiomp5.so")


def test_engine_warns_when_it_runs_on_libgomp_and_says_how_to_fix_it():
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CPUSERVE_REEXEC", "CPUSERVE_OPENMP")}
    code = "from cpuserve.engine import LLM; LLM(kv_cache_gb=0.05, show_progress=False)"
    out = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "runs torch's GNU OpenMP" in out.stderr and "reexec_with_intel_openmp()" in out.stderr
    assert "LD_PRELOAD=" + intel_openmp_library() in out.stderr


def test_no_warning_on_intel_openmp_or_when_gnu_is_chosen():
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CPUSERVE_REEXEC", "CPUSERVE_OPENMP")}
    code = ("import torch; from cpuserve.engine.threads import slow_openmp_warning; "
            "torch.ones(1 << 20).exp().sum(); print(slow_openmp_warning())")
    for env in ({**base, **openmp_env(base)}, {**base, "CPUSERVE_OPENMP": "gnu"}):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "None"
