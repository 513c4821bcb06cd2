"""Prefix-aware routing (serving/router.py) against Ray Serve's default router, on 2 replicas of `cpuserve serve`.

Two workloads, each sent to the same server started once per router (`router="prefix"`, cpuserve's default, and
`router="serve"`: Serve's own PowerOfTwoChoicesRequestRouter, unchanged), one after the other in every round,
which goes first alternating, through the OpenAI chat API with streaming and usage:

  shared  --system-prompts long system prompts (--system-tokens tokens each), --users-per-prompt users each; a
          request is one system prompt and its user's own short question, in a shuffled order. Each replica's KV
          pool (--kv-tokens) holds about half the system prompts besides the running requests, as when a
          service has more tenants than one replica can cache.
  random  every request its own random prompt of the same length: nothing to share (no loss allowed here).

Per run: TTFT p50/p99 (to the first token's event), output tokens per second (completion tokens over the run's
wall time), the prefix-cache hit rate (the usage's cached prompt tokens over all prompt tokens), the wall time and
the busiest replica's share of the requests. Per round: the two routers' ratios on each workload (paired: measured
in the same round) and the machine's load average (/proc/loadavg, 1 minute) before and after the round, so a round
that shared the cores with other work shows. The summary is each figure's median over the rounds with its min and
max, and the median of the per-round ratios with theirs. Prompts are texts decoded from random ordinary token ids
of the model's vocabulary, so their token counts are close to, not exactly, the sizes asked for.

    .venv/bin/python bench/prefix_routing.py [--rounds 5] [--workloads shared,random] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import time

import numpy as np

import machine
from serve_servers import wait_http
from workload import FIRST_ID, LAST_ID

KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * (1 + 4 / 64)  # SmolLM2: layers x KV heads x head dim x K,V, int8 + scales
TARGET_SPEEDUP = 1.5  # issue 47 item 4: TTFT p50 of the shared workload, with over without
ROUTERS = {"prefix": "prefix-affine", "serve": "Serve's default"}
METRICS = ("ttft_p50_ms", "ttft_p99_ms", "out_tok_s", "hit_rate", "wall_s", "busiest_share")
RATIOS = ("ttft_p50", "ttft_p99", "out_tok_s")  # prefix-affine against Serve's default, > 1: better


def make_texts(tokenizer, num: int, num_tokens: int, rng: np.random.Generator) -> list[str]:
    return [tokenizer.decode(rng.integers(FIRST_ID, LAST_ID, size=num_tokens).tolist()) for _ in range(num)]


def make_workloads(args, tokenizer) -> dict[str, list[list[dict]]]:
    rng = np.random.default_rng(args.seed)
    systems = make_texts(tokenizer, args.system_prompts, args.system_tokens, rng)
    num = args.system_prompts * args.users_per_prompt
    questions = make_texts(tokenizer, num, args.user_tokens, rng)
    shared = [[{"role": "system", "content": systems[i % args.system_prompts]},
               {"role": "user", "content": questions[i]}] for i in range(num)]
    random.Random(args.seed).shuffle(shared)
    randoms = [[{"role": "user", "content": text}]
               for text in make_texts(tokenizer, num, args.system_tokens + args.user_tokens, rng)]
    return {"shared": shared, "random": randoms}


@contextlib.contextmanager
def server(args, router: str):
    from cpuserve.serving.app import start_serving, stop_serving
    from cpuserve.serving.config import ServeConfig
    from cpuserve.serving.ports import free_port

    ports: set[int] = set()
    while len(ports) < 3:  # free_port() may give the same port twice
        ports.add(free_port())
    grpc_port, http_port, metrics_port = ports
    config = ServeConfig(replicas=2, cpus_per_rank=1, kv_cache_gb=args.kv_tokens * KV_BYTES_PER_TOKEN / 2**30,
                         max_num_seqs=args.concurrency, router=router, grpc_port=grpc_port,
                         http_port=http_port, metrics_port=metrics_port)
    try:
        start_serving(config)
        wait_http(f"http://127.0.0.1:{config.http_port}/v1/models")
        yield f"http://127.0.0.1:{config.http_port}"
    finally:
        stop_serving()


async def run(base_url: str, conversations: list[list[dict]], concurrency: int, max_tokens: int) -> dict:
    import aiohttp

    gate, ttfts, prompt, cached, completion, errors = asyncio.Semaphore(concurrency), [], 0, 0, 0, []
    served: dict[str, int] = {}

    async def one(session, messages):
        nonlocal prompt, cached, completion
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        async with gate:
            start, ttft, usage = time.perf_counter(), None, None
            async with session.post(f"{base_url}/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    errors.append(f"HTTP {r.status}: {(await r.read())[:200]!r}")
                    return
                replica = r.headers.get("x-cpuserve-replica", "")
                served[replica] = served.get(replica, 0) + 1
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if ttft is None and chunk["choices"]:  # the first token's event
                        ttft = time.perf_counter() - start
                    usage = chunk.get("usage") or usage
        if ttft is None or usage is None:
            errors.append("a stream without content or usage")
            return
        ttfts.append(ttft)
        prompt += usage["prompt_tokens"]
        cached += usage["prompt_tokens_details"]["cached_tokens"]
        completion += usage["completion_tokens"]

    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        await asyncio.gather(*(one(session, m) for m in conversations))
    wall = time.perf_counter() - start
    return {"ttft_p50_ms": float(np.percentile(ttfts, 50)) * 1e3 if ttfts else float("nan"),
            "ttft_p99_ms": float(np.percentile(ttfts, 99)) * 1e3 if ttfts else float("nan"),
            "out_tok_s": completion / wall, "hit_rate": cached / prompt if prompt else 0.0, "wall_s": wall,
            "busiest_share": max(served.values()) / sum(served.values()) if served else 0.0,
            "done": len(ttfts), "failed": len(errors), "error": errors[0] if errors else ""}


def round_ratios(ours: dict, theirs: dict) -> dict[str, float]:
    """Prefix-affine against Serve's default on one workload in one round (> 1: better)."""
    return {"ttft_p50": theirs["ttft_p50_ms"] / ours["ttft_p50_ms"],
            "ttft_p99": theirs["ttft_p99_ms"] / ours["ttft_p99_ms"],
            "out_tok_s": ours["out_tok_s"] / theirs["out_tok_s"]}


def spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def print_summary(args, workloads, rows: dict[tuple[str, str], list[dict]], ratios: dict[str, list[dict]]) -> None:
    print(f"\nmedian (min-max) over {args.rounds} rounds ({args.system_prompts * args.users_per_prompt} requests each, "
          f"{args.concurrency} at a time, 2 replicas x 1 core, {args.kv_tokens} KV tokens each):")
    columns = {"ttft_p50_ms": ("TTFT p50 ms", ".0f"), "ttft_p99_ms": ("TTFT p99 ms", ".0f"),
               "out_tok_s": ("out tok/s", ".1f"), "hit_rate": ("hit rate", ".2f"), "busiest_share": ("busiest", ".2f")}
    print(f"{'workload':8} {'router':15} " + " ".join(f"{label:>18}" for label, _ in columns.values()))
    for (name, router), runs in rows.items():
        cells = [(spread([row[k] for row in runs]), fmt) for k, (_, fmt) in columns.items()]
        print(f"{name:8} {ROUTERS[router]:15} " + " ".join(
            f"{f'{m:{fmt}} ({lo:{fmt}}-{hi:{fmt}})':>18}" for (m, lo, hi), fmt in cells))
    print(f"\nprefix-affine against Serve's default, paired in each round (> 1: better), median (min-max) of "
          f"{args.rounds} rounds:")
    for name in workloads:
        cells = {k: spread([r[k] for r in ratios[name]]) for k in RATIOS}
        print(f"{name:8} " + ", ".join(f"{label} {m:.2f}x ({lo:.2f}-{hi:.2f})" for label, (m, lo, hi) in zip(
            ("TTFT p50 lower", "TTFT p99 lower", "out tok/s"), cells.values()))
              + (f" (target: TTFT p50 >= {TARGET_SPEEDUP}x)" if name == "shared" else " (target: no loss, >= 1)"))


def load_average() -> float:
    """The machine's 1-minute load average (/proc/loadavg): above the bench's own ~2, other work shared the cores."""
    return os.getloadavg()[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--users-per-prompt", type=int, default=12)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--kv-tokens", type=int, default=5632,
                   help="each replica's KV pool, tokens (the default: half the system prompts, as tokenized, and the "
                        "running requests)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workloads", default="shared,random")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    args = p.parse_args()
    from cpuserve.engine.loader import load_checkpoint

    workloads = make_workloads(args, load_checkpoint(None, show_progress=False).tokenizer)
    workloads = {name: workloads[name] for name in args.workloads.split(",")}
    print(machine.describe(), flush=True)
    rows: dict[tuple[str, str], list[dict]] = {}
    ratios: dict[str, list[dict]] = {name: [] for name in workloads}
    loads = []
    for r in range(args.rounds):
        before = load_average()
        for router in (ROUTERS if r % 2 == 0 else reversed(ROUTERS)):
            with server(args, router) as url:
                # a server's first requests run slower (its first steps, Serve's first routes): not measured
                asyncio.run(run(url, [[{"role": "user", "content": f"Warm up {i}."}] for i in range(args.concurrency)],
                                args.concurrency, args.max_tokens))
                for name, conversations in workloads.items():
                    row = asyncio.run(run(url, conversations, args.concurrency, args.max_tokens))
                    rows.setdefault((name, router), []).append(row)
                    print(f"round {r} {name:6} {ROUTERS[router]:15} " + " ".join(
                        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        loads.append({"before": before, "after": load_average()})
        for name in workloads:
            ratios[name].append(round_ratios(rows[(name, "prefix")][-1], rows[(name, "serve")][-1]))
        print(f"round {r} load average {before:.2f} -> {loads[-1]['after']:.2f}: " + "; ".join(
            f"{name} " + " ".join(f"{k} {v:.2f}x" for k, v in ratios[name][-1].items()) for name in workloads),
            flush=True)
    print_summary(args, workloads, rows, ratios)
    failed = [(key, row["failed"], row["error"]) for key, runs in rows.items() for row in runs if row["failed"]]
    for (name, router), num, error in failed:  # a run with failures measured fewer requests: say so
        print(f"{name} / {ROUTERS[router]}: {num} requests failed, the first: {error}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine.describe(), "args": vars(args), "load_average": loads,
                       "ratios": ratios, "runs": {f"{n} / {r}": v for (n, r), v in rows.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
