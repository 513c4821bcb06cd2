"""What structured outputs cost a batched decode step (SmolLM2, the engine alone, no serving).

    flock /tmp/cpuserve-bench.lock .venv/bin/python bench/structured.py [--seqs 32] [--steps 40] [--reps 3]

Runs `seqs` sequences of one chat prompt to steady decode three ways: all free, all constrained by one JSON
schema (a long string field, so no sequence finishes while timed), and half of each; then times `steps` decode
steps of each (engine.last_step_seconds: runner + sampler, the part the feature touches). The ratio
constrained / free is the cost of the feature per step; the issue's target is <= 1.1 at 32 sequences. Then the
mask alone: sampler.mask_constrained over `seqs` rows, split into filling the bitmasks (llguidance) and applying
them, per token. The three ways run interleaved, one batch each per repetition, so drift hits all alike.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time, "thread": time.thread_time}
SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000, "maxLength": 3000}},
          "required": ["story"], "additionalProperties": False}


def steady_step_ms(llm, prompt: list[int], params: list, steps: int, clock: str = "wall") -> float:
    """Median decode step (ms) of one batch: add every request, step through the prefill, then time.

    clock "wall": the engine's own step time; "cpu": CPU seconds of the whole process (all threads) per step;
    "thread": CPU seconds of this thread (it runs the sampler and its share of the model). Other jobs on a busy
    machine inflate CPU time less than wall time.
    """
    engine = llm.engine
    requests = [engine.make_request(prompt, p) for p in params]
    for r in requests:
        engine.add(r)
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = CLOCKS[clock]()
        engine.step()
        times.append(engine.last_step_seconds if clock == "wall" else CLOCKS[clock]() - t0)
    for r in requests:
        engine.abort_request(r.request_id)
    engine.step()  # let the scheduler free them
    return 1000 * statistics.median(times)


def mask_us_per_token(llm, grammar_spec, seqs: int, clock: str, reps: int = 20) -> tuple[float, float]:
    """(fill, apply) microseconds per constrained row, for `seqs` rows at the schema's first string token."""
    from cpuserve.engine.sampler import fill_bitmask, mask_constrained

    tok = llm.tokenizer
    matchers = [llm.engine.grammars.matcher(grammar_spec) for _ in range(seqs)]
    for m in matchers:
        for t in tok.encode('{"story": "Once', add_special_tokens=False):
            assert m.consume_token(t), "the bench's prefix does not follow its own schema"
    vocab = llm.engine.args.vocab_size
    logits = torch.randn(seqs, vocab)
    row = torch.empty((vocab + 31) // 32, dtype=torch.int32)
    now = CLOCKS[clock]
    fill, total = [], []
    for _ in range(reps):
        t0 = now()
        for m in matchers:
            fill_bitmask(m, row)
        fill.append(now() - t0)
        t0 = now()
        mask_constrained(logits, matchers)
        total.append(now() - t0)
    f, t = statistics.median(fill), statistics.median(total)
    return 1e6 * f / seqs, 1e6 * (t - f) / seqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--clock", choices=list(CLOCKS), default="wall",
                    help="cpu / thread: CPU time per step, for a busy machine (see steady_step_ms)")
    args = ap.parse_args()
    from cpuserve.engine.threads import reexec_with_intel_openmp

    reexec_with_intel_openmp()  # what `cpuserve serve` runs: torch's libgomp is slower off the main thread
    from cpuserve.engine.grammar import StructuredOutput
    from cpuserve.engine.llm import LLM
    from cpuserve.engine.sampling_params import SamplingParams

    llm = LLM(weights="int4", kv_cache="int8", kv_cache_gb=1.0, max_num_seqs=args.seqs, show_progress=False)
    tok = llm.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me a long story as JSON."}]),
                        add_special_tokens=False)
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    free = SamplingParams(max_tokens=1 << 12, temperature=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=1 << 12, temperature=0, structured_output=spec)
    ways = {"free": [free] * args.seqs, "constrained": [constrained] * args.seqs,
            "half": [free, constrained] * (args.seqs // 2)}
    results: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.reps):
        for name, params in ways.items():
            results[name].append(steady_step_ms(llm, prompt, params, args.steps, args.clock))
    med = {k: statistics.median(v) for k, v in results.items()}
    fill_us, apply_us = mask_us_per_token(llm, spec, args.seqs, args.clock)
    print(f"{llm.engine.num_threads} threads, {args.seqs} sequences, median {args.clock} decode step of "
          f"{args.steps} steps x {args.reps} reps")
    for name in ways:
        print(f"  {name:12s} {med[name]:8.1f} ms/step   ratio vs free {med[name] / med['free']:.3f}")
    print(f"  mask per constrained token: fill {fill_us:.0f} us + apply {apply_us:.0f} us = "
          f"{fill_us + apply_us:.0f} us ({args.seqs} rows: {args.seqs * (fill_us + apply_us) / 1000:.2f} ms/step)")


if __name__ == "__main__":
    main()
