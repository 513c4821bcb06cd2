"""Decode speed of a replica group against one rank; part of bench/tp.py. Each configuration runs in its own
spawned process, so binding rank 0 never touches the parent."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
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


def _run_topk(model, batch, prompt_len, gen_tokens, reps, params_kw, results):
    """One 2-rank group; reduced top-k and full-logit gathering alternate run by run, so drift hits both alike."""
    from cpuserve.engine.llm import LLM

    llm = LLM(model=model, weights="int4", kv_cache_gb=0.25, show_progress=False, ranks=2)
    try:
        runs = {True: [], False: []}
        _decode(llm.engine, batch, prompt_len, 4, params_kw)  # warm-up
        for _ in range(reps):
            for candidates in (True, False):
                llm.engine.runner.use_candidates = candidates
                runs[candidates].append(_decode(llm.engine, batch, prompt_len, gen_tokens, params_kw)["step_ms"])
        results.put(("ok", {"topk_step_ms": statistics.median(runs[True]),
                            "full_step_ms": statistics.median(runs[False])}))
    except BaseException as e:
        results.put(("error", f"{type(e).__name__}: {e}"))
    finally:
        llm.engine.close()


def measure_topk(model: str | None, batch: int, params_kw: dict, gen_tokens: int = 32, reps: int = 5,
                 prompt_len: int = 32) -> dict:
    """Median step ms of a 2-rank group sampling from reduced top-k candidates and from gathered full logits."""
    return _in_process(_run_topk, (model, batch, prompt_len, gen_tokens, reps, params_kw))


def _run(model, ranks, threads, tp_mode, batch, prompt_len, gen_tokens, reps, params_kw, results):
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
        _decode(llm.engine, batch, prompt_len, 4, params_kw)  # warm-up
        runs = [_decode(llm.engine, batch, prompt_len, gen_tokens, params_kw) for _ in range(reps)]
        best = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]  # the median run
        results.put(("ok", best))
    except BaseException as e:
        results.put(("error", f"{type(e).__name__}: {e}"))
    finally:
        llm.engine.close()


def measure(model: str | None, ranks: int, threads: int = 1, tp_mode: str = "exact", batch: int = 1,
            prompt_len: int = 32, gen_tokens: int = 32, reps: int = 3, params_kw: dict | None = None) -> dict:
    return _in_process(_run, (model, ranks, threads, tp_mode, batch, prompt_len, gen_tokens, reps,
                              params_kw or dict(temperature=0)))


def _in_process(target, args: tuple) -> dict:
    """target(*args, results) in a spawned process; its result, or a RuntimeError with its error."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, results))
    p.start()
    try:
        while True:  # a child that dies before reporting (an import error, a crash) must not hang the benchmark
            try:
                status, value = results.get(timeout=1.0)
                break
            except queue.Empty:
                if not p.is_alive():
                    raise RuntimeError(f"benchmark process exited with code {p.exitcode} before reporting") from None
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
    if status != "ok":
        raise RuntimeError(value)
    return value
