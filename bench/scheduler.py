"""The scheduler's own CPU per decode step (schedule + postprocess, prefix caching on), no model.

    python bench/scheduler.py [--requests 64] [--context 2048] [--steps 200] [--reps 5]

Every request sits at `context` tokens and decodes one token a step, as in a long-context batch; the step cost is
what the engine thread spends outside the runner. Prints medians of `reps` runs of `steps` steps, per size.
"""
from __future__ import annotations

import argparse
import statistics
import time

from cpuserve.engine.block_manager import BlockManager
from cpuserve.engine.outputs import ModelRunnerOutput
from cpuserve.engine.request import Request
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.engine.scheduler import Scheduler

BLOCK = 16


def step_ms(num_requests: int, context: int, steps: int) -> float:
    blocks = num_requests * (-(-(context + steps) // BLOCK) + 1)
    scheduler = Scheduler(BlockManager(blocks, BLOCK, enable_prefix_caching=True), num_requests, 1 << 20)
    params = SamplingParams(max_tokens=1 << 20, temperature=0)
    for i in range(num_requests):  # distinct prompts: no request hits another's blocks
        scheduler.add(Request(f"r{i}", [(i * 7919 + t) % 40000 + 1 for t in range(context)], params))
    out = scheduler.schedule()  # the whole prefill in one step
    scheduler.postprocess(out, ModelRunnerOutput.place(out.scheduled, [1] * num_requests, [None] * num_requests))
    start = time.perf_counter()
    for _ in range(steps):
        out = scheduler.schedule()
        scheduler.postprocess(out, ModelRunnerOutput.place(out.scheduled, [1] * num_requests,
                                                           [None] * num_requests))
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    print(f"{'requests':>8} {'context':>8} {'ms/step (median)':>17} {'min':>7} {'max':>7}")
    for n in args.requests:
        for ctx in args.context:
            runs = [step_ms(n, ctx, args.steps) for _ in range(args.reps)]
            print(f"{n:>8} {ctx:>8} {statistics.median(runs):>17.3f} {min(runs):>7.3f} {max(runs):>7.3f}")


if __name__ == "__main__":
    main()
