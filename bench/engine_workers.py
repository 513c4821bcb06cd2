"""The measuring side of bench/engine.py: each engine runs in its own process so peak RSS is its own.

    python bench/engine_workers.py TASK < config.json     # prints one JSON line: the measured numbers

TASK is one of TASKS. The config is a dict of sizes (see engine.py `sizes`); the answer carries the medians,
every repetition, and the process's peak RSS (ru_maxrss). Decode speed everywhere is tokens produced after
every sequence has its first token, over the time they took: prefill is measured apart, never mixed in.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FIRST_ID, LAST_ID = 200, 40000  # ordinary tokens of the SmolLM2 vocabulary: no special or control tokens


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def make_prompts(num_seqs: int, length: int, seed: int) -> list[list[int]]:
    """Random token ids, different for every repetition: a repeated prompt would hit cpuserve's prefix cache."""
    rng = np.random.default_rng(seed)
    return rng.integers(FIRST_ID, LAST_ID, size=(num_seqs, length)).tolist()


def repeat(fn, reps: int, seed0: int) -> dict:
    """One warm-up call, then `reps` calls with fresh prompts: {"median": ..., "runs": [...]}."""
    fn(seed0 - 1)
    runs = [fn(seed0 + i) for i in range(reps)]
    return {"median": statistics.median(runs), "runs": runs}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# -- cpuserve -------------------------------------------------------------------------------------------
def cpuserve_prefill(llm, prompt: list[int]) -> float:
    from cpuserve.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return len(prompt) / (time.perf_counter() - start)


def cpuserve_decode(llm, prompts: list[list[int]], gen_tokens: int) -> float:
    """Aggregate decode tokens/s of all prompts under continuous batching, counted once all are prefilled."""
    from cpuserve.engine.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=gen_tokens, temperature=0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    started, start, num_timed = set(), None, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if start is not None:
            num_timed += sum(len(o.new_token_ids) for o in outputs)
            continue
        started.update(o.request_id for o in outputs if o.new_token_ids)
        if len(started) == len(prompts):  # every sequence has its first token: decode starts now
            start = time.perf_counter()
    return num_timed / (time.perf_counter() - start)


def kv_tokens(cfg: dict) -> int:
    """KV capacity every engine gets: the largest measurement's tokens, padded as llama.cpp pads contexts."""
    def pad(n: int) -> int:
        return -(-n // 256) * 256

    decode = max((b * pad(cfg["prompt_len"] + cfg["gen_tokens"]) for b in cfg["batches"]), default=0)
    return max(decode, pad(cfg.get("prefill_len", 0) + 1))


def load_cpuserve(cfg: dict):
    import torch

    from cpuserve.engine.llm import LLM
    from cpuserve.engine.loader import load_checkpoint
    from cpuserve.engine.model_runner import kv_bytes_per_token

    torch.set_num_threads(cfg["threads"])
    # the pool is pre-allocated and touched at start: size it like llama.cpp's context, not the 1 GiB default,
    # so peak RSS compares like with like (one block of slack per sequence for block rounding)
    args = load_checkpoint(cfg["model"], show_progress=False).args
    tokens = kv_tokens(cfg) + 16 * max(cfg["batches"], default=1)
    kv_gb = tokens * kv_bytes_per_token(args, "int8") / (1 << 30)
    # otherwise the engine's defaults: int4 weights, int8 KV cache
    return LLM(model=cfg["model"], num_threads=cfg["threads"], kv_cache_gb=kv_gb, show_progress=False)


def measure_cpuserve(cfg: dict) -> dict:
    llm = load_cpuserve(cfg)
    out: dict = {"decode": {}}
    if cfg.get("prefill_len"):
        log(f"cpuserve: prefill {cfg['prefill_len']} tokens")
        out["prefill"] = repeat(lambda s: cpuserve_prefill(llm, make_prompts(1, cfg["prefill_len"], s)[0]),
                                cfg["reps"], 1000)
    for batch in cfg["batches"]:
        log(f"cpuserve: decode batch {batch}, {cfg['gen_tokens']} tokens each")
        out["decode"][str(batch)] = repeat(
            lambda s: cpuserve_decode(llm, make_prompts(batch, cfg["prompt_len"], s), cfg["gen_tokens"]),
            cfg["reps"], 2000 + 100 * batch)
    return out


def profile_cpuserve(cfg: dict) -> dict:
    """Where decode time goes: torch.profiler over one decode run per batch size, top ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    llm = load_cpuserve(cfg)
    tables = {}
    for batch in cfg["batches"]:
        log(f"cpuserve profile: decode batch {batch}")
        cpuserve_decode(llm, make_prompts(batch, cfg["prompt_len"], 1), 4)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            rate = cpuserve_decode(llm, make_prompts(batch, cfg["prompt_len"], 2), cfg["gen_tokens"])
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=cfg.get("top", 15))
        tables[str(batch)] = {"tok_s_under_profiler": rate, "table": table}
    return {"profile": tables}


# -- attention and KV bytes ---------------------------------------------------------------------------
def measure_attention(cfg: dict) -> dict:
    import torch

    from attention import run, tune_malloc

    torch.set_num_threads(cfg["threads"])
    tune_malloc()  # the engine tunes glibc malloc at start; the kernels are measured the same way
    log(f"attention: SlimAttention vs SDPA prefill at {cfg['attn_lens']} tokens")
    rows = run(prefill_lens=tuple(cfg["attn_lens"]), dtypes=(torch.bfloat16,), batches=(), repeats=cfg["reps"])
    return {"attention": rows}


def measure_kv_bytes(cfg: dict) -> dict:
    from cpuserve.engine.loader import load_checkpoint
    from cpuserve.engine.model_runner import kv_bytes_per_token

    args = load_checkpoint(cfg["model"], show_progress=False).args
    return {"kv_bytes": {dtype: kv_bytes_per_token(args, dtype) for dtype in ("int8", "bf16")}}


def _peer(name: str):
    import peers

    return getattr(peers, name)


TASKS = {
    "cpuserve": measure_cpuserve,
    "profile": profile_cpuserve,
    "attention": measure_attention,
    "kv_bytes": measure_kv_bytes,
    "llama_cpp": lambda cfg: _peer("measure_llama_cpp")(cfg),
    "hf": lambda cfg: _peer("measure_hf")(cfg),
}


def run_worker(task: str, cfg: dict, timeout: float | None = None) -> dict:
    """Run TASK in a fresh Python process; returns its numbers, or {"error": why} if it failed.

    The child's stderr (progress, tracebacks) goes straight to ours; its answer is the last JSON line of stdout.
    """
    try:
        proc = subprocess.run([sys.executable, os.path.join(HERE, "engine_workers.py"), task],
                              input=json.dumps(cfg), stdout=subprocess.PIPE, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    answers = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not answers:  # killed (out of memory?) or crashed in native code before answering
        return {"error": f"{task} process died with exit code {proc.returncode} before answering"}
    return json.loads(answers[-1])


def main() -> None:
    task, cfg = sys.argv[1], json.loads(sys.stdin.read())
    try:
        result = TASKS[task](cfg)
    except ImportError as e:  # an optional peer (llama_cpp, transformers) that is not installed
        result = {"error": f"not installed: {e}"}
    except Exception as e:  # reported in the table, never hidden
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    result["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
