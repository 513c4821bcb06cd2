"""Where a served token's time goes: CPU per output token of every process (and of the replica's threads).

For the engine alone and for cpuserve over HTTP and gRPC at each --streams level, it runs the level of
bench/serving.py (same client, same prompts) and reads the CPU time every process of the run used meanwhile
(/proc, through psutil): this process (the client; for cpuserve also Ray's driver), the LLMServer replica (split
into its threads: the engine thread with its OpenMP workers, the replica's event loop, Ray's and grpc's threads),
the Ingress replica, Serve's proxy and Ray's own processes. Each is given as microseconds of CPU per output token
and as a share of one core over the level's wall time; with the wall time per token, that is the budget of
docs/serving.md.

    .venv/bin/python bench/serve_budget.py [--streams 1,32] [--max-tokens 128] [--prompts-per-stream 1]
                                           [--serve-options "field=value,..."] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import psutil

from serve_client import run_level
from serve_servers import cpuserve
from serving import engine_alone
from workload import make_prompts

# process kinds by their command line (Ray names its workers ray::<actor class>:<method>)
KINDS = (("LLMServer", "LLMServer replica"), ("Ingress", "Ingress replica"), ("ProxyActor", "Serve proxy"),
         ("ServeController", "Serve controller"), ("gcs_server", "Ray GCS"), ("raylet", "raylet"))


def kind_of(proc: psutil.Process) -> str:
    if proc.pid == os.getpid():
        return "client (bench process)"
    try:
        line = " ".join(proc.cmdline())
    except psutil.Error:
        return "gone"
    return next((label for key, label in KINDS if key in line), "other Ray processes")


def snapshot(engine_here: bool) -> dict[tuple, float]:
    """CPU seconds by (pid, tid or 0, kind or thread name) for this process and all its descendants; the process
    running the engine (the LLMServer replica, or this one for the engine alone) thread by thread."""
    me = psutil.Process()
    out = {}
    for proc in [me] + me.children(recursive=True):
        try:
            kind = kind_of(proc)
            if kind == "LLMServer replica" or (engine_here and proc.pid == me.pid):
                for t in proc.threads():
                    out[(proc.pid, t.id, _thread_name(proc.pid, t.id))] = t.user_time + t.system_time
            else:
                times = proc.cpu_times()
                out[(proc.pid, 0, kind)] = times.user + times.system
        except psutil.Error:
            continue
    return out


def _thread_name(pid: int, tid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def budget(before: dict, after: dict, tokens: int, wall: float) -> dict[str, dict[str, float]]:
    """CPU per kind over the level. In the engine's process the main thread runs the event loop (the replica's
    serving code and Ray's handle calls, or the client), Intel's OpenMP names its workers `openmp_worker`, and the
    engine thread is the busiest of the others (Python does not name OS threads: each carries a copy of the main
    thread's name)."""
    delta = {key: cpu - before.get(key, 0.0) for key, cpu in after.items()}
    threads = {key: d for key, d in delta.items() if key[1]}
    others = [key for key in threads if key[1] != key[0] and key[2] != "openmp_worker"]
    engine = max(others, key=threads.get, default=None)
    where = "bench process" if all(key[0] == os.getpid() for key in threads) else "replica"
    per_kind: dict[str, float] = {}
    for key, d in delta.items():
        if not key[1]:
            kind = key[2]
        elif key[1] == key[0]:
            kind = f"{where}: main thread (event loop)"
        elif key[2] == "openmp_worker":
            kind = f"{where}: engine's OpenMP workers"
        elif key == engine:
            kind = f"{where}: engine thread"
        else:
            kind = f"{where}: Ray's and grpc's threads"
        per_kind[kind] = per_kind.get(kind, 0.0) + d
    return {kind: {"us_per_token": 1e6 * cpu / tokens, "core_share": cpu / wall}
            for kind, cpu in sorted(per_kind.items(), key=lambda kv: -kv[1]) if cpu > 0}


async def measure(target, levels: list[int], args, engine_here: bool) -> dict[int, dict]:
    async with target() as send:
        await run_level(send, make_prompts(2, args.prompt_len, 99), 2, 4)  # warm-up
        rows = {}
        for n in levels:
            prompts = make_prompts(n * args.prompts_per_stream, args.prompt_len, 1000 + n)
            before, load = snapshot(engine_here), os.getloadavg()[0]
            level = await run_level(send, prompts, n, args.max_tokens)
            after, tokens = snapshot(engine_here), sum(level.tokens)
            rows[n] = {**level.row(), "tokens": tokens, "wall_s": level.wall, "load_1min_before": load,
                       "ms_per_token": 1e3 * level.wall / tokens if tokens else float("nan"),
                       "messages": sum(level.messages),
                       "cpu": budget(before, after, tokens, level.wall) if tokens else {}}
            print(f"  {n:>3} streams: {rows[n]['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
        return rows


def report(results: dict) -> str:
    lines = []
    for label, by_n in results.items():
        for n, row in by_n.items():
            per_message = row["tokens"] / row["messages"] if row.get("messages") else None  # tokens per message
            head = (f"### {label}, {n} streams: {row['tok_s']:.1f} tok/s, {row['ms_per_token']:.2f} ms of wall per "
                    f"token, TTFT p50 {row['ttft_p50']:.0f} ms, load before {row['load_1min_before']:.2f}")
            if per_message:  # the client counted them: CPU per streamed message too
                head += f", {row['messages']} streamed messages ({per_message:.2f} tokens each)"
            extra = " CPU us per message |" if per_message else ""
            lines += [head, "| process / thread | CPU us per token | % of one core |" + extra,
                      "|---|---:|---:|" + "---:|" * bool(per_message)]
            lines += [f"| {kind} | {c['us_per_token']:.0f} | {100 * c['core_share']:.1f} |"
                      + (f" {c['us_per_token'] * per_message:.0f} |" if per_message else "")
                      for kind, c in row["cpu"].items()]
            lines.append("")
    return "\n".join(lines)


def main() -> None:
    from cpuserve.engine.threads import reexec_with_intel_openmp

    reexec_with_intel_openmp()
    from cpuserve.engine.loader import default_model_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", default="1,32")
    p.add_argument("--prompts-per-stream", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--serve-options", default="", help="ServeConfig fields for cpuserve: key=value,...")
    p.add_argument("--no-engine", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    model, levels = default_model_path(), [int(x) for x in args.streams.split(",")]
    options = dict(kv.split("=", 1) for kv in filter(None, args.serve_options.split(",")))
    results = {}
    servers = ([] if args.no_engine else [engine_alone]) + [lambda m, t, s: cpuserve(m, t, s, options)]
    for server in servers:
        with server(model, args.threads, max(levels)) as targets:
            time.sleep(2)  # let start-up work settle before the first snapshot
            for label, target in targets.items():
                print(f"{label} ...", file=sys.stderr, flush=True)
                results[label] = asyncio.run(measure(target, levels, args, label == "engine alone"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    print(report(results))


if __name__ == "__main__":
    main()
