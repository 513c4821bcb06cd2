"""Soak: `cpuserve serve` under mixed traffic for a while, then checks that nothing was lost, leaked or miscounted.

    python bench/soak.py --duration 120         # the short form `make test` runs (tests/bench/test_soak.py)
    make soak                                    # 30 minutes: python bench/soak.py --duration 1800

64 clients run at once, half gRPC Generate streams and half HTTP SSE /v1/completions, each sending one request after
another: prompts of ~10, ~200 or ~800 tokens, 8 to 256 output tokens, 20% cancelled by the client at a random token,
10% of gRPC ones with a 0.3-3 s deadline, a quarter greedy samples of fixed prompts. Every `--burst-every-s` a burst
of short non-streamed requests (half each protocol) goes past the admission bound. Checks, after the traffic stops:

  outcomes   every request completed, was refused at admission (503 + Retry-After / RESOURCE_EXHAUSTED) or was
             cancelled by its client (or its deadline); none failed (5xx, an error event, another status) or hung
  greedy     every completed greedy sample equals the engine alone, token for token (gRPC) or text (HTTP)
  kv-free    the KV pool is entirely free, nothing running or waiting
  memory     each serving process's RssAnon + VmSwap grew less than 5% (or 2 MiB) from --baseline-s to the end: its
             low-water mark over a window after the baseline against the one over the last window of traffic (a
             sixth of the run, at most 5 minutes, sampled every 30 s or less). A garbage-collected process swings
             like a sawtooth (the Ingress by 6 MiB of ~100 every few minutes), so one sample at each end would judge
             the swing's phase; a leak lifts the low-water mark too
  metrics    the server's request counters (by finish reason, refusals) equal the client's counts (a client that left
             may have left after the last token was sent: the server then counts it finished)

Not a benchmark (it needs no bench lock): it runs itself at nice 10. Exit code 0 when every check passes.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from soak_checks import (check_greedy, check_kv_free, check_memory, check_metrics_settled, check_outcomes,  # noqa: E402
                         scrape)
from soak_clients import GREEDY_PROMPTS, Bounds, Plan, Result, RunClock, bounded, grpc_complete, grpc_stream, \
    http_complete, http_stream, make_plan  # noqa: E402

from cpuserve.serving.ports import free_port  # noqa: E402

SERVE_FLAGS = ["--kv-cache-gb", "0.25", "--max-num-seqs", "32", "--max-queued-requests", "48"]  # 80 in flight at most
OUTCOMES = ("completed", "refused", "cancelled", "deadline", "failed", "hung")


def start_serve(log) -> tuple[subprocess.Popen, dict[str, int]]:
    ports = {"grpc": free_port(), "http": free_port(), "metrics": free_port()}
    cpuserve = os.path.join(os.path.dirname(sys.executable), "cpuserve")  # this environment's
    proc = subprocess.Popen([cpuserve, "serve", "--grpc-port", str(ports["grpc"]), "--http-port", str(ports["http"]),
                             "--metrics-port", str(ports["metrics"]), *SERVE_FLAGS], stdout=log, stderr=log,
                            start_new_session=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"cpuserve serve exited with {proc.returncode}; its log: {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{ports['http']}/health", timeout=15).status_code == 200:
                return proc, ports
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"cpuserve serve did not become healthy in 300 s; its log: {log.name}")


def memory_of(root: int) -> dict[int, tuple[str, int]]:
    """pid -> (name, RssAnon + VmSwap in kB) of every process under root."""
    out = {}
    for p in [psutil.Process(root), *psutil.Process(root).children(recursive=True)]:
        try:
            fields = dict(line.split(":", 1) for line in open(f"/proc/{p.pid}/status"))
            out[p.pid] = (p.name(), int(fields["RssAnon"].split()[0]) + int(fields.get("VmSwap", "0 kB").split()[0]))
        except (OSError, KeyError, psutil.Error):
            pass
    return out


async def drive(ports: dict[str, int], args, results: list[Result], memory: dict, root: int) -> float:
    import aiohttp
    import grpc

    from cpuserve.v1 import inference_pb2_grpc as pbg

    url, end = f"http://127.0.0.1:{ports['http']}", time.monotonic() + args.duration
    start, b = time.monotonic(), Bounds(args.hang_s, asyncio.Event(), RunClock())
    asyncio.get_running_loop().call_later(args.duration, b.stop.set)  # then every client leaves, its request cancelled
    ticking = asyncio.ensure_future(b.clock.run())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['grpc']}") as channel, aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)) as session:
        stub = pbg.InferenceStub(channel)

        async def client(i: int) -> None:
            rng, proto = random.Random(args.seed * 1000 + i), "grpc" if i % 2 else "http"
            while not b.stop.is_set():
                plan = make_plan(rng, proto)
                send = grpc_stream(stub, plan, b) if proto == "grpc" else http_stream(session, url, plan, b)
                r = await bounded(send, b, proto, "stream", whole=False)
                results.append(r)
                if r.outcome == "refused":
                    await asyncio.sleep(r.retry_after)

        async def bursts() -> None:
            while time.monotonic() + args.burst_every_s < end:
                await asyncio.sleep(args.burst_every_s)
                short = Plan("Say hello.", 4)
                sends = [bounded(grpc_complete(stub, short) if k % 2 else http_complete(session, url, short),
                                 b, "grpc" if k % 2 else "http", "burst") for k in range(args.burst_size)]
                results.extend(await asyncio.gather(*sends))

        async def watch() -> None:
            await asyncio.sleep(min(args.baseline_s, args.duration))
            memory["samples"] = [(time.monotonic() - start, memory_of(root))]
            print(f"[{time.monotonic() - start:6.0f} s] memory baseline taken; {len(results)} requests so far",
                  flush=True)
            shown = time.monotonic()
            while time.monotonic() + memory_sample_s(args.duration) < end:
                await asyncio.sleep(memory_sample_s(args.duration))
                memory["samples"].append((time.monotonic() - start, mem := memory_of(root)))
                if time.monotonic() - shown >= 30:
                    shown = time.monotonic()
                    big = sorted(mem.values(), key=lambda v: -v[1])[:6]
                    print(f"[{time.monotonic() - start:6.0f} s] {len(results)} requests; RssAnon+VmSwap MiB: "
                          + ", ".join(f"{name} {kb / 1024:.1f}" for name, kb in big), flush=True)

        await asyncio.gather(*(client(i) for i in range(args.clients)), bursts(), watch())
    ticking.cancel()
    return time.monotonic() - start


def memory_sample_s(duration: float) -> float:
    """Seconds between memory samples: 30, or less in a short run (at least 4 samples in its last window)."""
    return min(30.0, memory_window_s(duration) / 4)


def memory_window_s(duration: float) -> float:
    """The windows the low-water marks are taken over: a sixth of the run, at most 5 minutes."""
    return min(300.0, duration / 6)


def summary(results: list[Result], elapsed: float) -> dict:
    table = {o: {p: sum(r.outcome == o and r.proto == p for r in results) for p in ("grpc", "http")}
             for o in OUTCOMES}
    ttft = [r.ttft for r in results if r.ttft is not None and r.outcome == "completed"]
    itl = [r.itl for r in results if r.itl is not None and r.outcome == "completed"]
    pct = (lambda xs, q: round(float(np.percentile(xs, q)) * 1e3, 1) if xs else None)
    return {"outcomes": table, "requests": len(results), "seconds": round(elapsed, 1),
            "tokens_per_s": round(sum(r.tokens for r in results) / elapsed, 1),
            "ttft_ms": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)}, "itl_ms": {"p50": pct(itl, 50), "p99": pct(itl, 99)}}


def print_table(s: dict, checks: list[tuple[str, bool, str]]) -> None:
    print(f"\nsoak: {s['requests']} requests in {s['seconds']} s, {s['tokens_per_s']} tokens/s (client-side count)")
    print("| outcome | gRPC | HTTP | total |\n| --- | ---: | ---: | ---: |")
    for outcome, row in s["outcomes"].items():
        print(f"| {outcome} | {row['grpc']} | {row['http']} | {row['grpc'] + row['http']} |")
    print(f"\nTTFT p50 {s['ttft_ms']['p50']} ms, p99 {s['ttft_ms']['p99']} ms; ITL (mean per request) p50 "
          f"{s['itl_ms']['p50']} ms, p99 {s['itl_ms']['p99']} ms\n")
    print("| check | result | detail |\n| --- | --- | --- |")
    for name, ok, detail in checks:
        print(f"| {name} | {'pass' if ok else 'FAIL'} | {detail} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=1800, help="seconds of traffic (default: 1800)")
    p.add_argument("--clients", type=int, default=64, help="concurrent streams, half gRPC, half HTTP (default: 64)")
    p.add_argument("--baseline-s", type=float, default=120,
                   help="when the memory baseline is taken, seconds into the traffic; at most half the duration "
                        "(default: 120)")
    p.add_argument("--burst-every-s", type=float, default=20, help="seconds between bursts (default: 20)")
    p.add_argument("--burst-size", type=int, default=64, help="requests in one burst (default: 64)")
    p.add_argument("--hang-s", type=float, default=120,
                   help="a request with nothing for this long (first token, next message, unary answer) hung "
                        "(default: 120)")
    p.add_argument("--memory-min-mib", type=float, default=0,
                   help="judge the memory growth of processes holding this much at the baseline only (the short form: "
                        "Ray's small daemons are still warming up in its first minutes) (default: 0, every process)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the summary and the checks here")
    args = p.parse_args(argv)
    args.baseline_s = min(args.baseline_s, args.duration / 2)
    os.nice(10)  # not a benchmark: yield to whatever else runs here (serve and Ray inherit it)
    log = tempfile.NamedTemporaryFile("w+", prefix="soak-serve-", suffix=".log", delete=False)
    print(f"starting cpuserve serve {' '.join(SERVE_FLAGS)} (log: {log.name})", flush=True)
    proc, ports = start_serve(log)
    results: list[Result] = []
    memory: dict = {}
    try:
        before = scrape(ports["metrics"])
        print(f"driving {args.clients} clients for {args.duration:g} s", flush=True)
        elapsed = asyncio.run(drive(ports, args, results, memory, proc.pid))
        checks = [check_outcomes(results), check_kv_free(ports["metrics"]),
                  check_metrics_settled(ports["metrics"], before, results),
                  check_memory(memory["samples"], memory_window_s(args.duration), int(args.memory_min_mib * 1024))]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    checks.insert(1, check_greedy(results, GREEDY_PROMPTS))  # the engine alone, once serving has stopped
    s = summary(results, elapsed)
    print_table(s, checks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**s, "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in checks]}, f, indent=1)
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
