"""A pod's cold start: `cpuserve serve` from process start to its endpoints, and to the first streamed token.

Starts the `cpuserve` command given (default: this environment's; for an installed wheel, its venv's), waits for
/health, then streams one chat completion and notes when its first token arrives. --fresh-cache points the
kernels' cache at an empty folder, as a new pod has: a checkout then compiles its level first (the developer
path), a wheel loads its prebuilt library.

    .venv/bin/python bench/cold_start.py [--cpuserve PATH] [--fresh-cache] [--runs 1] [-- serve flags ...]
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
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


def one_run(cpuserve: str, fresh_cache: bool, serve_args: list[str]) -> tuple[float, float]:
    ports = {"grpc": free_port(), "http": free_port(), "metrics": free_port()}
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    cache = tempfile.TemporaryDirectory(prefix="cpuserve-kernels-") if fresh_cache else None
    if cache:
        env["CPUSERVE_KERNEL_CACHE"] = cache.name
    args = [cpuserve, "serve", *(a for k, p in ports.items() for a in (f"--{k}-port", str(p))), *serve_args]
    start = time.monotonic()
    proc = subprocess.Popen(args, env=env, cwd=tempfile.gettempdir(), start_new_session=True)
    try:
        while not healthy(ports["http"]):
            if proc.poll() is not None:
                raise RuntimeError(f"cpuserve serve exited with {proc.returncode}")
            time.sleep(0.2)
        ready = time.monotonic() - start
        return ready, first_token_seconds(ports["http"], start)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)
        if cache:
            cache.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpuserve", default=str(Path(sys.executable).parent / "cpuserve"),
                        help="the cpuserve command to start (default: this environment's)")
    parser.add_argument("--fresh-cache", action="store_true", help="an empty kernels cache, as a new pod has")
    parser.add_argument("--runs", type=int, default=1, help="starts to time (default: 1)")
    parser.add_argument("serve_args", nargs="*", help="flags passed to cpuserve serve (after --)")
    args = parser.parse_args()
    for run in range(args.runs):
        ready, first = one_run(args.cpuserve, args.fresh_cache, args.serve_args)
        print(f"run {run + 1}: endpoints ready {ready:.1f} s, first token {first:.1f} s after process start",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
