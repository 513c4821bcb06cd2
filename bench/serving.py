"""Served speed: what one neutral client sees from cpuserve and each peer server at 1, 8 and 32 streams.

Every server runs alone on the same CPUs (started, measured, stopped; serve_servers.py) and gets the same random
prompts of --prompt-len tokens (as token ids), --max-tokens output tokens, ignore-eos, temperature 0, from the
same streaming client (serve_client.py: output tokens from `usage`, TTFT to the first text). A level sends
--prompts-per-stream x concurrency prompts with at most `concurrency` in flight, as `vllm bench serve
--max-concurrency` does. Rounds are interleaved (each round starts every server once, in a rotated order) and the
table gives the medians over --rounds. The engine alone (AsyncLLMEngine in this process, tokens counted from its
steps) is the ceiling the served path is held to.

    .venv/bin/python bench/serving.py [--servers cpuserve,llamacpp,vllm,openvino] [--streams 1,8,32]
                                      [--rounds 3] [--prompts-per-stream 3] [--no-engine] [--json out.json]
                                      [--serve-options "stream_messages_per_s=0;stream_interval_ms=200"]
(--servers "" with --serve-options measures only the cpuserve variants given there)
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import sys
import time
import uuid

import numpy as np

import machine
from serve_client import run_level
from serve_servers import SERVERS
from workload import make_prompts

TARGET_RATIO, ENGINE_SHARE = 1.2, 0.85  # issue 14 item 4: >= 1.2x the best peer; >= 85% of the engine at 32


@contextlib.contextmanager
def engine_alone(model: str, threads: int, max_streams: int):
    from cpuserve.engine.async_engine import AsyncLLMEngine
    from cpuserve.engine.sampling_params import SamplingParams

    engine = AsyncLLMEngine.from_config(model=model, num_threads=threads, kv_cache_gb=0.5, show_progress=False)

    async def send(prompt, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        start, ttft, tokens = time.perf_counter(), None, 0
        async for step in engine.generate(prompt, params, uuid.uuid4().hex):
            if ttft is None and step.new_token_ids:
                ttft = time.perf_counter() - start
            tokens += len(step.new_token_ids)
        return ttft, tokens

    @contextlib.asynccontextmanager
    async def target():
        yield send

    try:
        yield {"engine alone": target}
    finally:
        engine.shutdown()


async def measure(target, levels: list[int], args, round_: int, index: int = 0) -> dict[int, dict]:
    """index: the target's place among one server's targets (cpuserve's HTTP, then gRPC). Each gets prompts of its
    own, so the second is not served from the prefix cache the first one filled; every server's first target gets
    the same prompts."""
    async with target() as send:
        await run_level(send, make_prompts(2, args.prompt_len, 10_000 + round_ + 100 * index), 2, 4)  # warm-up
        rows = {}
        for n in levels:
            prompts = make_prompts(n * args.prompts_per_stream, args.prompt_len, 1000 * round_ + n + 500 * index)
            rows[n] = (await run_level(send, prompts, n, args.max_tokens)).row()
            print(f"  {n:>3} streams: {json.dumps(rows[n])}", file=sys.stderr, flush=True)
        return rows


def run(args) -> tuple[dict, dict]:
    """results[label][streams] = rows of every round; failures[name] = why a server gave no numbers."""
    levels = [int(x) for x in args.streams.split(",")]
    servers = {"engine": engine_alone, **SERVERS}
    for options in filter(None, args.serve_options.split(";")):  # more cpuserve servers, other ServeConfigs
        fields = dict(kv.split("=", 1) for kv in options.split(","))
        servers[f"cpuserve {options}"] = functools.partial(SERVERS["cpuserve"], options=fields)
    variants = list(servers)[1 + len(SERVERS):]
    names = ([] if args.no_engine else ["engine"]) + list(filter(None, args.servers.split(","))) + variants
    results, failures = {}, {}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # interleaved: each round starts elsewhere
        for name in order:
            print(f"round {r + 1}: {name} ...", file=sys.stderr, flush=True)
            try:
                with servers[name](args.model, args.threads, max(levels)) as targets:
                    for index, (label, target) in enumerate(targets.items()):
                        rows = asyncio.run(measure(target, levels, args, r, index))
                        for n, row in rows.items():
                            results.setdefault(label, {}).setdefault(n, []).append(row)
            except Exception as e:  # noqa: BLE001 - one server failing must not lose the others' numbers
                failures[name] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"{name} failed: {failures[name]}", file=sys.stderr, flush=True)
    return results, failures


def medians(rows: list[dict]) -> dict:
    out = {k: float(np.median([r[k] for r in rows])) for k in ("tok_s", "ttft_p50", "ttft_p99")}
    out.update(failed=sum(r["failed"] for r in rows), sent=sum(r["done"] + r["failed"] for r in rows),
               short=sum(r["short"] for r in rows),
               error=next((r["error"] for r in rows if r["error"]), ""))
    return out


def table(results: dict, failures: dict, args) -> str:
    levels = [int(x) for x in args.streams.split(",")]
    med = {label: {n: medians(rows) for n, rows in by_n.items()} for label, by_n in results.items()}
    lines = [f"{args.prompt_len}-token prompts, {args.max_tokens} output tokens, ignore-eos, temperature 0; "
             f"{args.threads} threads; medians of {args.rounds} rounds; TTFT in ms",
             "| server | streams | output tok/s | TTFT p50 | TTFT p99 | failed |", "|---|---:|---:|---:|---:|---:|"]
    for label, by_n in med.items():
        for n, m in by_n.items():
            failed = f"{m['failed']} of {m['sent']}" + (f" ({m['error'][:60]})" if m["error"] else "")
            failed += f"; {m['short']} short of {args.max_tokens} tokens" if m["short"] else ""
            lines.append(f"| {label} | {n} | {m['tok_s']:.1f} | {m['ttft_p50']:.0f} | {m['ttft_p99']:.0f} | "
                         f"{failed} |")
    lines += [f"| {name} | - | failed: {why} | | | |" for name, why in failures.items()]
    peers = [label for label in med if not label.startswith(("cpuserve", "engine"))]
    ours = [label for label in med if label.startswith("cpuserve")]
    lines += ["", f"Targets (issue 14 item 4): served tok/s >= {TARGET_RATIO}x the best peer at each level with "
              f"TTFT p99 no worse than that peer's; at {max(levels)} streams >= {ENGINE_SHARE:.0%} of the engine",
              "| streams | best peer | its tok/s | its TTFT p99 | " + " | ".join(f"{o} / best" for o in ours) + " |",
              "|---:|---|---:|---:|" + "---:|" * len(ours)]
    for n in levels:
        ranked = sorted((p for p in peers if n in med[p]), key=lambda p: -med[p][n]["tok_s"])
        if not ranked:
            continue
        best = med[ranked[0]][n]
        cells = []
        for o in ours:
            if n in med[o]:
                ratio, p99 = med[o][n]["tok_s"] / best["tok_s"], med[o][n]["ttft_p99"]
                ok = ratio >= TARGET_RATIO and p99 <= best["ttft_p99"]
                cells.append(f"{ratio:.2f}x, p99 {p99:.0f} ms {'met' if ok else 'missed'}")
        lines.append(f"| {n} | {ranked[0]} | {best['tok_s']:.1f} | {best['ttft_p99']:.0f} | " + " | ".join(cells)
                     + " |")
    top = max(levels)
    if "engine alone" in med and top in med["engine alone"]:
        engine = med["engine alone"][top]["tok_s"]
        for o in ours:
            if top in med[o]:
                share = med[o][top]["tok_s"] / engine
                lines.append(f"{o} at {top} streams: {share:.0%} of the engine alone ({engine:.1f} tok/s): "
                             f"{'met' if share >= ENGINE_SHARE else 'missed'}")
    return "\n".join(lines)


def main() -> None:
    # as `cpuserve serve` runs: Intel's OpenMP preloaded (peer servers get an environment without it)
    from cpuserve.engine.threads import reexec_with_intel_openmp

    reexec_with_intel_openmp()
    from cpuserve.engine.loader import default_model_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of: {', '.join(SERVERS)}")
    p.add_argument("--streams", default="1,8,32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts-per-stream", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--model", default=None, help="a GGUF file (default: the packaged SmolLM2)")
    p.add_argument("--serve-options", default="",
                   help="more cpuserve servers with other ServeConfig values: `;` between servers, `,` between "
                        "key=value fields, e.g. \"stream_messages_per_s=0;stream_interval_ms=200\"")
    p.add_argument("--no-engine", action="store_true", help="skip the engine-alone ceiling")
    p.add_argument("--json", default=None, help="also write every round's rows here")
    args = p.parse_args()
    args.model = args.model or default_model_path()
    unknown = set(filter(None, args.servers.split(","))) - set(SERVERS)
    if unknown:
        p.error(f"--servers: unknown {sorted(unknown)}; known: {', '.join(SERVERS)}")
    cpu_line = machine.describe(machine.int8_peak_gmacs())  # before any server starts: a quiet core
    print(cpu_line, file=sys.stderr, flush=True)
    results, failures = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": cpu_line, "results": results, "failures": failures}, f, indent=1)
    print("\n" + cpu_line + "\n" + table(results, failures, args))


if __name__ == "__main__":
    main()
