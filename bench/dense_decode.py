"""Decode with fp32 / bf16 weights: dense_gemm (the decode rows' row-invariant GEMM, engine/csrc/dense_gemm.cpp)
against F.linear (what every row ran before it), one engine per weight format, the GEMM switched per measurement.

    python bench/dense_decode.py [--weights bf16 fp32] [--streams 1 8] [--reps 3] [--gen-tokens 32] [--prefill-len 512]

Decode tok/s as bench/engine.py counts it (tokens after every stream has its first one; 32-token random prompts),
the two GEMMs alternating (which goes first alternates too), medians over --reps; ratio = dense_gemm / F.linear
(> 1: faster); and prefill tok/s of one 512-token prompt the same way (bf16 prompt rows take F.linear either
way, fp32 ones dense_gemm); Intel's OpenMP is preloaded, as the cpuserve command does. Run it under the bench lock: the machine is shared.
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
from engine_workers import cpuserve_decode, cpuserve_prefill  # noqa: E402
from workload import make_prompts  # noqa: E402

from cpuserve.engine.layers.linear.dense import DenseLinear  # noqa: E402
from cpuserve.engine.llm import LLM  # noqa: E402

GEMMS = ("F.linear", "dense_gemm")


def use(llm: LLM, gemm: str) -> None:
    """Every dense layer of the model on `gemm` (DenseLinear.use_torch_gemm)."""
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, DenseLinear)]
    assert layers, "no DenseLinear in the model: not fp32 / bf16 weights?"
    for m in layers:
        m.use_torch_gemm = gemm == "F.linear"


def measure(weights: str, streams: list[int], reps: int, gen_tokens: int, threads: int,
            prefill_len: int = 0) -> list[dict]:
    """One row per number of streams (decode tok/s), and with prefill_len one for a prompt of that many tokens
    (prefill tok/s; streams "prefill")."""
    llm = LLM(weights=weights, num_threads=threads, kv_cache_gb=0.25, show_progress=False)
    cases = {n: lambda seed, n=n: cpuserve_decode(llm, make_prompts(n, 32, seed), gen_tokens) for n in streams}
    if prefill_len:
        cases["prefill"] = lambda seed: cpuserve_prefill(llm, make_prompts(1, prefill_len, seed)[0])
    rows = []
    for j, (n, run) in enumerate(cases.items()):
        tok_s = {g: [] for g in GEMMS}
        for rep in range(reps + 1):  # the first: a warm-up, not counted
            order = GEMMS if rep % 2 else GEMMS[::-1]
            for i, gemm in enumerate(order):
                use(llm, gemm)
                got = run(seed=1000 * rep + 10 * j + i)  # new prompts each time: no prefix cache hit
                if rep:
                    tok_s[gemm].append(got)
        med = {g: statistics.median(v) for g, v in tok_s.items()}
        rows.append({"weights": weights, "streams": n, **{f"{g} tok/s": round(med[g], 1) for g in GEMMS},
                     "ratio": round(med["dense_gemm"] / med["F.linear"], 3),
                     "runs": {g: [round(t, 1) for t in v] for g, v in tok_s.items()}})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-len", type=int, default=512, help="also prefill tok/s of one such prompt (0: not)")
    a = ap.parse_args()
    print(machine.describe())
    rows = [r for w in a.weights for r in measure(w, a.streams, a.reps, a.gen_tokens, a.threads, a.prefill_len)]
    print(f"\ndecode tok/s, medians of {a.reps}, {a.gen_tokens} new tokens a stream, {a.threads} threads")
    print("| weights | streams | F.linear | dense_gemm | ratio |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['weights']} | {r['streams']} | {r['F.linear tok/s']} | {r['dense_gemm tok/s']} | {r['ratio']:.2f}x |")


if __name__ == "__main__":
    main()
