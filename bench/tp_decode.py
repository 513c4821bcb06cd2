"""Decode speed of a replica group against one rank; part of bench/tp.py. Each configuration runs in its own
spawned process, so binding rank 0 never touches the parent."""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time


def _decode(engine, batch: int, prompt_len: int, gen_tokens: int, params_kw: dict) -> dict:
    """Prefill `batch` prompts, then time decode steps only; returns per-step and per-token figures."""
    from cpuserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=gen_tokens, ignore_eos=True, **params_kw)
    for i in range(batch):
        engine.add_request([(7 * i + j) % 1000 + 100 for j in range(prompt_len)], params)
    while engine.scheduler.num_waiting:  # prefill (and the first token) outside the timing
        engine.step()
    runner = engine.runner
    comm = getattr(runner, "comm", None)
    if comm is not None:
        comm.stats.reset()
        runner.compute_seconds = 0.0
    steps, tokens, start = 0, 0, time.perf_counter()
    step_times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        step_times.append(time.perf_counter() - t)
        steps += 1
    wall = time.perf_counter() - start
    out = dict(tok_s=tokens / wall, step_ms=statistics.median(step_times) * 1e3)
    if comm is not None:
        out.update(comm_frac=comm.stats.seconds / wall, compute_frac=runner.compute_seconds / wall,
                   bytes_per_token=comm.stats.num_bytes / tokens, copied_per_token=comm.stats.copied_bytes / tokens,
                   ops_per_step=comm.stats.num_ops / steps)
    return out


def _run(model, ranks, threads, tp_mode, batch, prompt_len, gen_tokens, reps, candidates, params_kw, results):
    from cpuserve.engine.llm import LLM

    kw = dict(model=model, weights="int4", kv_cache_gb=0.25, show_progress=False, ranks=ranks)
    if ranks == 1:
        cores = sorted(os.sched_getaffinity(0))[:threads]
        os.sched_setaffinity(0, cores)
        kw["num_threads"] = threads
    else:
        kw["tp_mode"] = tp_mode
    llm = LLM(**kw)
    try:
        if ranks > 1:
            llm.engine.runner.use_candidates = candidates
        _decode(llm.engine, batch, prompt_len, 4, params_kw)  # warm-up
        runs = [_decode(llm.engine, batch, prompt_len, gen_tokens, params_kw) for _ in range(reps)]
        best = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]  # the median run
        results.put(("ok", best))
    except BaseException as e:
        results.put(("error", f"{type(e).__name__}: {e}"))
    finally:
        llm.engine.close()


def measure(model: str | None, ranks: int, threads: int = 1, tp_mode: str = "exact", batch: int = 1,
            prompt_len: int = 32, gen_tokens: int = 32, reps: int = 3, candidates: bool = True,
            params_kw: dict | None = None) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    p = ctx.Process(target=_run, args=(model, ranks, threads, tp_mode, batch, prompt_len, gen_tokens, reps,
                                       candidates, params_kw or dict(temperature=0), results))
    p.start()
    try:
        status, value = results.get(timeout=1800)
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
    if status != "ok":
        raise RuntimeError(value)
    return value
