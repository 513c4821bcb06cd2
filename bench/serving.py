"""Serving benchmark: throughput, TTFT and inter-token latency at 1, 8 and 32 concurrent streams.

Three targets, one after another on the same CPUs, same model, same threads, same prompts and token counts:
  engine   AsyncLLMEngine called directly in this process (the ceiling);
  serve    `cpuserve serve`'s app (1 replica) over gRPC streams, through Ray Serve's proxy;
  llamacpp llama.cpp's own server (`python -m llama_cpp.server`) over its OpenAI-compatible HTTP (SSE).
Every request generates exactly --max-tokens tokens (ignore_eos; llama.cpp gets a large negative EOS bias).

    .venv/bin/python bench/serving.py [--streams 1,8,32] [--max-tokens 64] [--threads 2] [--skip llamacpp]
                                      [--serve-options "stream_messages_per_s=0;stream_interval_ms=200"]
(--serve-options: one serve target per `;`-separated set of ServeConfig fields, `,` between fields)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import socket
import subprocess
import sys
import time
import uuid

import numpy as np

TOPICS = ["the sea", "bicycles", "prime numbers", "Rome", "vaccines", "cats", "autumn", "light", "bread",
          "volcanoes", "lighthouses", "chess", "the moon", "jazz", "bees", "glaciers"]


def prompt(i: int) -> str:
    return f"Write a short essay about {TOPICS[i % len(TOPICS)]} (part {i})."


class Run:
    """Timings of one concurrency level: per-stream token arrival times."""

    def __init__(self):
        self.streams: list[tuple[float, list[float]]] = []  # (start, [arrival of each token])

    def row(self, wall: float) -> dict[str, float]:
        ttft = [arr[0] - s for s, arr in self.streams if arr]
        itl = [b - a for _, arr in self.streams for a, b in zip(arr, arr[1:])]
        tokens = sum(len(arr) for _, arr in self.streams)
        return {"tok_s": tokens / wall, "ttft_p50": np.percentile(ttft, 50) * 1e3,
                "ttft_p99": np.percentile(ttft, 99) * 1e3, "itl_p50": np.percentile(itl, 50) * 1e3 if itl else 0,
                "itl_p99": np.percentile(itl, 99) * 1e3 if itl else 0, "tokens": tokens}


async def measure(one, n: int, max_tokens: int) -> dict[str, float]:
    run = Run()

    async def stream(i):
        start, arrivals = time.perf_counter(), []
        async for num_tokens in one(i, max_tokens):
            arrivals.extend([time.perf_counter()] * num_tokens)
        run.streams.append((start, arrivals))

    start = time.perf_counter()
    await asyncio.gather(*(stream(i) for i in range(n)))
    return run.row(time.perf_counter() - start)


# -- targets ------------------------------------------------------------------------------------------------
def bench_engine(levels, max_tokens, threads) -> dict[int, dict]:
    from cpuserve.engine.async_engine import AsyncLLMEngine
    from cpuserve.engine.sampling_params import SamplingParams

    engine = AsyncLLMEngine.from_config(num_threads=threads, kv_cache_gb=0.5, show_progress=False)

    async def one(i, n):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        async for chunk in engine.generate(prompt(i), params, uuid.uuid4().hex):
            yield len(chunk.new_token_ids)

    try:
        asyncio.run(measure(one, 2, 4))  # warm-up
        return {n: asyncio.run(measure(one, n, max_tokens)) for n in levels}
    finally:
        engine.shutdown()


def bench_serve(levels, max_tokens, threads, options: dict | None = None) -> dict[int, dict]:
    import grpc

    from cpuserve.serving.app import start_serving, stop_serving
    from cpuserve.serving.config import ServeConfig
    from cpuserve.v1 import inference_pb2 as pb
    from cpuserve.v1 import inference_pb2_grpc as pbg

    config = ServeConfig(replicas=1, cpus_per_rank=threads, kv_cache_gb=0.5, max_num_seqs=64, grpc_port=free_port(),
                         http_port=free_port(), metrics_port=free_port(), **(options or {}))
    start_serving(config)
    try:
        async def run(n, tokens):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{config.grpc_port}") as channel:
                stub = pbg.InferenceStub(channel)
                await stub.Health(pb.HealthRequest(), wait_for_ready=True, timeout=300)

                async def one(i, m):
                    sampling = pb.SamplingParameters(max_tokens=m, temperature=0, ignore_eos=True)
                    async for r in stub.Generate(pb.GenerateRequest(text=prompt(i), sampling=sampling)):
                        yield len(r.token_ids)

                return await measure(one, n, tokens)

        asyncio.run(run(2, 4))
        return {n: asyncio.run(run(n, max_tokens)) for n in levels}
    finally:
        stop_serving()


# `python -m llama_cpp.server` with ggml's extra buffer types off, as bench/peers.py loads llama.cpp: its AMX
# path crashes on VMs that advertise AMX (CPUSERVE_BENCH_LLAMA_EXTRA_BUFTS=1 keeps them on).
LLAMA_SERVER = """
import os, runpy, sys
import llama_cpp.llama_cpp as C
default = C.llama_model_default_params
def params():
    p = default()
    p.use_extra_bufts = os.environ.get("CPUSERVE_BENCH_LLAMA_EXTRA_BUFTS") == "1"
    return p
C.llama_model_default_params = params
sys.argv[0] = "llama_cpp.server"
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""


def bench_llamacpp(levels, max_tokens, threads) -> dict[int, dict]:
    import httpx

    from cpuserve.engine.loader import default_model_path

    port = free_port()
    cmd = [sys.executable, "-c", LLAMA_SERVER, "--model", default_model_path(), "--host", "127.0.0.1",
           "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "8192",
           "--interrupt_requests", "False"]  # its default: a new request cuts off the running stream
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # llama.cpp with its own OpenMP runtime
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models")

        async def run(n, tokens):
            async with httpx.AsyncClient(timeout=600) as client:
                async def one(i, m):
                    body = {"prompt": prompt(i), "max_tokens": m, "temperature": 0, "stream": True,
                            "logit_bias": {"0": -100, "2": -100}}  # SmolLM2's EOS ids: never stop early
                    async with client.stream("POST", url, json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                                yield 1

                return await measure(one, n, tokens)

        asyncio.run(run(1, 4))
        return {n: asyncio.run(run(n, max_tokens)) for n in levels}
    finally:
        server.terminate()
        server.wait(timeout=30)


# -- helpers ------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer in {timeout} s")


def main() -> None:
    # as `cpuserve serve` runs: Intel's OpenMP preloaded, so the in-process engine steps in its thread at full speed
    from cpuserve.engine.threads import reexec_with_intel_openmp

    reexec_with_intel_openmp()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--skip", default="", help="comma-separated targets to skip: engine, serve, llamacpp")
    p.add_argument("--serve-options", default="",
                   help="serve targets with other ServeConfig values: `;` between targets, `,` between key=value "
                        "fields (default: one target with the server's defaults)")
    args = p.parse_args()
    levels = [int(x) for x in args.streams.split(",")]
    targets = {"engine": bench_engine, "serve": bench_serve, "llamacpp": bench_llamacpp}
    if args.serve_options:
        serve = {f"serve {o}": functools.partial(bench_serve, options=dict(kv.split("=") for kv in o.split(",")))
                 for o in args.serve_options.split(";")}
        targets = {"engine": bench_engine, **serve, "llamacpp": bench_llamacpp}
    results = {}
    for name, fn in targets.items():
        if name.split()[0] not in args.skip.split(","):
            print(f"running {name} ...", file=sys.stderr, flush=True)
            try:
                results[name] = fn(levels, args.max_tokens, args.threads)
            except Exception as e:  # one target failing must not lose the others' numbers
                print(f"{name} failed: {e!r}", file=sys.stderr, flush=True)
                continue
            print(name, json.dumps(results[name]), file=sys.stderr, flush=True)
    print(f"\n{args.max_tokens} tokens per stream, {args.threads} threads; latencies in ms")
    print("| target | streams | tok/s | vs engine | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, rows in results.items():
        for n, r in rows.items():
            ratio = f"{r['tok_s'] / results['engine'][n]['tok_s']:.0%}" if "engine" in results else "-"
            print(f"| {name} | {n} | {r['tok_s']:.1f} | {ratio} | {r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | "
                  f"{r['itl_p50']:.1f} | {r['itl_p99']:.1f} |")


if __name__ == "__main__":
    main()
