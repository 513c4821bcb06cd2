"""What a verification step costs at real sizes, and what the acceptance seen on SmolLM2 would buy there.

    flock /tmp/cpuserve-bench.lock .venv/bin/python bench/spec_cost.py [--sizes smollm2 3b 8b] [--k 4] [--reps 5]

1. The acceptance. SmolLM2 (the only real weights here) runs bench/speculative.py's copy-heavy prompts at one
   stream with the n-gram drafter, counting its steps: those that verified a draft and those that ran one token.
2. The cost. At each size (SmolLM2, and the synthetic Llama 3.2 3B and Llama 3.1 8B Q4_K_M files of real_sizes.py,
   written once into ~/.cache/cpuserve-bench), one request decodes with a drafter that proposes k tokens every step:
   random weights never agree with it, so each such step verifies k + 1 rows and keeps one token. Blocks of steps
   with drafting on and off alternate in the same engine (the context grows by one token a step either way); the
   cost ratio c = median on-step / median off-step, whole engine.step() calls (scheduling, drafting, trimming too).
3. What it buys. With T tokens generated in P plain steps and V verification steps (1.), drafting replaces T
   one-token steps by P + c * V steps' time: projected speed-up = T / (P + c * V). Drafts shorter than k cost less
   than c, so this is a floor. On SmolLM2 the projection is printed beside the speed-up measured by running the
   same prompts with drafting off, so the model of the cost can be checked where both exist.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

CACHE_DIR = os.path.expanduser("~/.cache/cpuserve-bench")


class FixedDrafter:
    """Proposes k copies of the request's last token every step: a draft of k tokens to verify, whatever the model."""

    def prepare(self, requests, max_tokens: list[int]) -> None:
        pass  # nothing to compute ahead of propose

    def propose(self, request, max_tokens: int) -> list[int]:
        return [request.all_token_ids[-1]] * max_tokens

    def forget(self, request_id: str) -> None:
        pass


def engine_for(model: str | None, k: int, threads: int | None):
    from cpuserve.engine.llm import LLM

    llm = LLM(model=model, weights="int4", kv_cache="int8", kv_cache_gb=1.0, max_num_seqs=1, show_progress=False,
              speculative="ngram", spec_tokens=k, spec_max_batch=1, spec_pause_after=1 << 30,
              **({"num_threads": threads} if threads else {}))
    return llm


def acceptance(llm, max_tokens: int, prompts: int = 0) -> dict:
    """bench/speculative.py's copy-heavy set at one stream, drafting on then off: tokens, plain and verification
    steps with drafting on, the seconds of each mode's decode, and each output's length."""
    from speculative import COPY_HEAVY

    from cpuserve.engine.sampling_params import SamplingParams

    engine, tok = llm.engine, llm.tokenizer
    scheduler = engine.scheduler
    drafter = scheduler.drafter
    counts = {"tokens": 0, "plain": 0, "verify": 0, "on_s": 0.0, "off_s": 0.0, "outputs": []}
    for text in COPY_HEAVY[:prompts or None]:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
        outputs = {}
        for mode in ("on", "off"):
            scheduler.spec_policy.max_batch = 1 if mode == "on" else 0
            engine.block_manager.reset_prefix_cache()
            request = engine.make_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0))
            engine.add(request)
            out, seconds = [], 0.0
            while engine.has_unfinished_requests():
                drafted0 = scheduler.num_draft_tokens
                t0 = time.perf_counter()
                chunks = engine.step()
                dt = time.perf_counter() - t0
                new = [t for c in chunks for t in c.new_token_ids]
                if out:  # decode steps only (the first step prefills and yields the first token)
                    seconds += dt
                    if mode == "on":
                        counts["tokens"] += len(new)
                        counts["verify" if scheduler.num_draft_tokens > drafted0 else "plain"] += 1
                out += new
            counts[f"{mode}_s"] += seconds
            outputs[mode] = out
        if outputs["on"] != outputs["off"]:
            raise SystemExit("greedy outputs differ with speculation")
        counts["outputs"].append(len(outputs["on"]))
    scheduler.drafter = drafter
    return counts


def step_cost(llm, k: int, reps: int, steps: int) -> tuple[float, float, int]:
    """Median seconds of a one-token decode step and of a (k + 1)-row verification step, one request; and the
    draft tokens verified (k in each step with drafting on)."""
    from cpuserve.engine.sampling_params import SamplingParams

    engine = llm.engine
    scheduler = engine.scheduler
    drafter, scheduler.drafter = scheduler.drafter, FixedDrafter()
    engine.block_manager.reset_prefix_cache()
    prompt = list(range(1000, 1128))  # 128 tokens
    needed = 2 * reps * steps * (k + 1) + 8
    engine.add(engine.make_request(prompt, SamplingParams(max_tokens=needed, temperature=0, ignore_eos=True)))
    engine.step()  # the prefill
    drafted0 = scheduler.num_draft_tokens
    times = {"off": [], "on": []}
    for _ in range(reps):
        for mode in ("off", "on"):
            scheduler.spec_policy.max_batch = 1 if mode == "on" else 0
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                times[mode].append(time.perf_counter() - t0)
    for request in list(scheduler.running):
        engine.abort_request(request.request_id)
    scheduler.drafter = drafter
    return statistics.median(times["off"]), statistics.median(times["on"]), scheduler.num_draft_tokens - drafted0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["smollm2", "3b", "8b"], choices=["smollm2", "1b", "3b", "8b"])
    ap.add_argument("--k", type=int, default=4, help="draft tokens per verification (the engine's spec_tokens)")
    ap.add_argument("--reps", type=int, default=5, help="alternating blocks of steps, drafting off then on")
    ap.add_argument("--steps", type=int, default=8, help="steps per block")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    from cpuserve.engine.threads import reexec_with_intel_openmp

    reexec_with_intel_openmp()  # what `cpuserve serve` runs
    from machine import describe
    from real_sizes import synthetic_real

    print(describe(), flush=True)
    smol = engine_for(None, args.k, args.threads)
    counts = acceptance(smol, args.max_tokens)
    t, p, v = counts["tokens"], counts["plain"], counts["verify"]
    measured = counts["off_s"] / counts["on_s"]
    print(f"SmolLM2 copy-heavy, one stream, k={args.k}: {t} tokens in {p} plain + {v} verification steps "
          f"({t / (p + v):.2f} tokens a step); measured speed-up {measured:.2f}x", flush=True)
    print(f"{'model':10s} {'1-row step ms':>13s} {f'{args.k + 1}-row step ms':>13s} {'cost ratio':>10s} "
          f"{'projected speed-up':>18s}")
    for size in args.sizes:
        llm = smol if size == "smollm2" else engine_for(synthetic_real(size, CACHE_DIR), args.k, args.threads)
        one, verify, _ = step_cost(llm, args.k, args.reps, args.steps)
        c = verify / one
        extra = f" (measured {measured:.2f}x)" if size == "smollm2" else ""
        print(f"{size:10s} {1e3 * one:13.1f} {1e3 * verify:13.1f} {c:10.2f} {t / (p + c * v):17.2f}x{extra}",
              flush=True)
        if llm is not smol:
            del llm


if __name__ == "__main__":
    main()
