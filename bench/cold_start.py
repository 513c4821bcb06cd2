"""A pod's cold start: `cpuserve serve` from process start to its endpoints, and to the first streamed token.

Starts the `cpuserve` command given (default: this environment's; for an installed wheel, its venv's), waits for
/health, then streams one chat completion and notes when its first token arrives. --fresh-cache points the
kernels' cache at an empty folder, as a new pod has: a checkout then compiles its level first (the developer
path), a wheel loads its prebuilt library. Each run's Ray session lives in a folder of its own (RAY_TMPDIR), whose
logs give where the time went, in seconds after process start (the median of the runs at the end):

    command     the command printed its first line ("starting: ..."): imports, the config, the model found
    serve       Serve's controller logged its first line: Ray's processes started, serve.start called
    replica     the LLMServer replica started initializing: its worker process started and imported the app
    engine      the replica finished initializing: the engine loaded the model and allocated its KV pool
    health      /health answered 200: the Ingress is up and a probe token went through the engine
    token       the first streamed token of one chat completion arrived

    .venv/bin/python bench/cold_start.py [--cpuserve PATH] [--fresh-cache] [--runs 1] [-- serve flags ...]
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx

from cpuserve.serving.ports import free_port

PROMPT = "Name the largest planet of the solar system."


def first_token_seconds(http_port: int, start: float) -> float:
    body = {"model": "SmolLM2-135M-Instruct", "stream": True, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": PROMPT}]}
    with httpx.stream("POST", f"http://127.0.0.1:{http_port}/v1/chat/completions", json=body, timeout=600) as rsp:
        rsp.raise_for_status()
        for line in rsp.iter_lines():
            if line.startswith("data: ") and '"content":"' in line.replace(" ", ""):
                return time.monotonic() - start
    raise RuntimeError("the stream ended without a token")


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


PHASES = ("command", "serve", "replica", "engine", "health", "token")
# Ray Serve's log lines: "INFO 2026-11-29 09:26:39,732 cpuserve_LLMServer g1ti8rah -- Started initializing replica."
LOG_TIME = re.compile(r"^\w+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def log_seconds(path: Path, start_wall: float, marker: str = "") -> float | None:
    """Seconds after start_wall of the first line of a Ray Serve log that contains `marker`."""
    for line in path.read_text(errors="replace").splitlines():
        if marker in line and (m := LOG_TIME.match(line)):
            return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - start_wall
    return None


def serve_phases(ray_tmp: Path, start_wall: float) -> dict[str, float | None]:
    """The Serve controller's first line and the LLMServer replica's initialization, from the session's logs."""
    logs = next(ray_tmp.glob("ray/session_*/logs/serve"), None)
    if logs is None:
        return {}

    def first(pattern: str, marker: str = "") -> float | None:
        times = (log_seconds(p, start_wall, marker) for p in sorted(logs.glob(pattern)))
        return next((t for t in times if t is not None), None)

    return {"serve": first("controller_*.log"),
            "replica": first("replica_*LLMServer*.log", "Started initializing replica"),
            "engine": first("replica_*LLMServer*.log", "Finished initializing replica")}


def one_run(cpuserve: str, fresh_cache: bool, serve_args: list[str]) -> dict[str, float | None]:
    ports = {"grpc": free_port(), "http": free_port(), "metrics": free_port()}
    # unbuffered: the first line reaches the pipe when printed, as it reaches a terminal
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"), "PYTHONUNBUFFERED": "1"}
    cache = tempfile.TemporaryDirectory(prefix="cpuserve-kernels-") if fresh_cache else None
    if cache:
        env["CPUSERVE_KERNEL_CACHE"] = cache.name
    ray_tmp = tempfile.TemporaryDirectory(prefix="cs-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env["RAY_TMPDIR"] = ray_tmp.name
    args = [cpuserve, "serve", *(a for k, p in ports.items() for a in (f"--{k}-port", str(p))), *serve_args]
    phases: dict[str, float | None] = dict.fromkeys(PHASES)
    start, start_wall = time.monotonic(), time.time()
    proc = subprocess.Popen(args, env=env, cwd=tempfile.gettempdir(), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def read_stdout() -> None:  # "starting: ..." (stderr) once the config is read, then the endpoints (stdout)
        for line in proc.stdout:
            if phases["command"] is None and line.startswith("starting: "):
                phases["command"] = time.monotonic() - start
            sys.stdout.write(line)

    reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    try:
        while not healthy(ports["http"]):
            if proc.poll() is not None:
                raise RuntimeError(f"cpuserve serve exited with {proc.returncode}")
            time.sleep(0.1)
        phases["health"] = time.monotonic() - start
        phases["token"] = first_token_seconds(ports["http"], start)
        phases.update(serve_phases(Path(ray_tmp.name), start_wall))
        return phases
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)
        reader.join(10)
        ray_tmp.cleanup()
        if cache:
            cache.cleanup()


def row(label: str, phases: dict[str, float | None]) -> str:
    return f"{label:>7}  " + "  ".join(f"{name} {'-' if t is None else f'{t:.1f}'}" for name, t in phases.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpuserve", default=str(Path(sys.executable).parent / "cpuserve"),
                        help="the cpuserve command to start (default: this environment's)")
    parser.add_argument("--fresh-cache", action="store_true", help="an empty kernels cache, as a new pod has")
    parser.add_argument("--runs", type=int, default=1, help="starts to time (default: 1)")
    parser.add_argument("serve_args", nargs="*", help="flags passed to cpuserve serve (after --)")
    args = parser.parse_args()
    runs = []
    for run in range(args.runs):
        runs.append(one_run(args.cpuserve, args.fresh_cache, args.serve_args))
        print(row(f"run {run + 1}", runs[-1]) + "  (s after process start)", flush=True)
    median = {name: statistics.median(ts) if (ts := [r[name] for r in runs if r[name] is not None]) else None
              for name in PHASES}
    print(row("median", median) + f"  ({args.runs} runs)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
