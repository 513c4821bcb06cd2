"""fp32 prefill on SmolLM2: prefill attention on the C++ SlimAttention (engine/csrc/slim_attention_fp32.cpp) against
the plain-torch path (attention.slim_attention) it replaced, one engine, switched per measurement.

    python bench/prefill_fp32.py [--lengths 512 2048] [--reps 5]

Prefill tok/s of one random prompt of each length (a new prompt each time: no prefix cache hit; prompts past the
engine's 512-token step budget run in chunks), the two paths alternating (which goes first alternates too), medians
over --reps after a warm-up; ratio = kernel / torch (> 1: faster). Intel's OpenMP is preloaded, as the cpuserve
command does. Run it under the bench lock: the machine is shared. bench/attention.py --fp32 times the kernel alone.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

from cpuserve.engine.threads import reexec_with_intel_openmp

if __name__ == "__main__":
    reexec_with_intel_openmp()  # as the cpuserve command runs (before torch loads)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # noqa: E402
from engine_workers import cpuserve_prefill  # noqa: E402
from workload import make_prompts  # noqa: E402

from cpuserve.engine.layers import native  # noqa: E402
from cpuserve.engine.llm import LLM  # noqa: E402


def measure(lengths: list[int], reps: int, threads: int) -> list[dict]:
    llm = LLM(weights="fp32", num_threads=threads, kv_cache_gb=0.25, show_progress=False)
    kernel = native.slim_attention_fp32_enabled
    if not kernel():
        raise SystemExit("the fp32 SlimAttention kernel does not run here (no AVX-512 level, or CPUSERVE_KERNELS)")
    paths = {"torch": lambda: False, "kernel": kernel}  # what ops.prefill_attention asks
    rows = []
    for length in lengths:
        tok_s = {p: [] for p in paths}
        try:
            for rep in range(reps + 1):  # the first: a warm-up, not counted
                for i, path in enumerate(paths if rep % 2 else list(paths)[::-1]):
                    native.slim_attention_fp32_enabled = paths[path]
                    got = cpuserve_prefill(llm, make_prompts(1, length, 1000 * rep + i)[0])
                    if rep:
                        tok_s[path].append(got)
        finally:
            native.slim_attention_fp32_enabled = kernel
        med = {p: statistics.median(v) for p, v in tok_s.items()}
        rows.append({"prompt": length, **{f"{p} tok/s": round(m, 1) for p, m in med.items()},
                     "ratio": round(med["kernel"] / med["torch"], 3),
                     "runs": {p: [round(t) for t in v] for p, v in tok_s.items()}})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    print(machine.describe(), flush=True)
    measure(a.lengths, a.reps, a.threads)


if __name__ == "__main__":
    main()
