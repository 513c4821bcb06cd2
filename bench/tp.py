"""Replica groups (tensor parallel): communication and decode speed, 1 rank x 2 threads vs 2 ranks x 1 thread.

    python bench/tp.py allreduce      # all-reduce latency, shm transport vs gloo, 576..65536 floats
    python bench/tp.py decode         # decode tok/s, compute/communication split, bytes per token
    python bench/tp.py topk           # reduced top-k sampling vs all-gathering the full logits (step time; both in
                                      # one group, alternating run by run)
    python bench/tp.py all [--quick] [--skip-1b]
    python bench/tp.py decode --layouts exact,reduce   # only these rows (1x2 = the 1-rank baseline)
    python bench/tp.py decode --model moe=PATH         # these GGUFs instead of SmolLM2 and the 1B (a mixture of
                                                       # experts from bench/synthetic_gguf.py: expert-parallel ranks)

Decode rows: batch 1 and 8, greedy, 32 generated tokens after a 32-token prompt, median of 3 runs; 2-rank rows in
both layouts ("exact": bit-identical to 1 rank, 4 all-gathers per layer; "reduce": 2 all-reduces per layer).
"comm" is rank 0's time inside collectives (waiting for the slower rank included), "compute" its forward time
outside them; the rest of the step is scheduling, sampling and Python. The synthetic 1B GGUF is written once
into ~/.cache/cpuserve-bench by bench/engine.py's writer. The machine has 2 cores shared with other work:
compare ratios taken in one run.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


LAYOUTS = ("1x2", "exact", "reduce")


def decode_table(models: dict[str, str | None], batches, gen_tokens: int, reps: int,
                 layouts=LAYOUTS) -> list[str]:
    from tp_decode import measure

    rows = ["| model | batch | layout | tok/s | vs 1x2 | step ms | compute | comm | bytes/token | of which copied in | "
            "collectives/step |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, path in models.items():
        for batch in batches:
            base = None
            if "1x2" in layouts:
                base = measure(path, 1, threads=2, batch=batch, gen_tokens=gen_tokens, reps=reps)
                rows.append(f"| {name} | {batch} | 1 rank x 2 threads | {base['tok_s']:.1f} | 1.00x | "
                            f"{base['step_ms']:.1f} | | | | | |")
                print(rows[-1], flush=True)
            for mode in [m for m in ("exact", "reduce") if m in layouts]:
                r = measure(path, 2, tp_mode=mode, batch=batch, gen_tokens=gen_tokens, reps=reps)
                ratio = f"{r['tok_s'] / base['tok_s']:.2f}x" if base else ""
                rows.append(f"| {name} | {batch} | 2 ranks x 1 thread, {mode} | {r['tok_s']:.1f} | {ratio} | "
                            f"{r['step_ms']:.1f} | {r['compute_frac']:.0%} | {r['comm_frac']:.0%} | "
                            f"{r['bytes_per_token'] / 1024:.0f} KiB | {r['copied_per_token'] / 1024:.1f} KiB | "
                            f"{r['ops_per_step']:.0f} |")
                print(rows[-1], flush=True)
    return rows


def topk_table(models: dict[str, str | None], gen_tokens: int, reps: int) -> list[str]:
    from tp_decode import measure_topk

    rows = ["| model | batch | sampling | step ms, top-k candidates | step ms, full logits gathered | ratio |",
            "|---|---:|---|---:|---:|---:|"]
    cases = [("greedy", dict(temperature=0)), ("top_k=40, T=0.8", dict(temperature=0.8, top_k=40, seed=1))]
    for name, path in models.items():
        for label, kw in cases:
            for batch in (1, 8):
                r = measure_topk(path, batch, kw, gen_tokens=gen_tokens, reps=reps + 2)  # alternating runs
                rows.append(f"| {name} | {batch} | {label} | {r['topk_step_ms']:.2f} | {r['full_step_ms']:.2f} | "
                            f"{r['full_step_ms'] / r['topk_step_ms']:.2f}x |")
                print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["allreduce", "decode", "topk", "all"], nargs="?", default="all")
    parser.add_argument("--iters", type=int, default=200, help="all-reduces per timed batch")
    parser.add_argument("--quick", action="store_true", help="smoke run: few tokens, one repetition")
    parser.add_argument("--skip-1b", action="store_true")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"decode rows, comma-separated from {LAYOUTS}")
    parser.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                        help="decode rows of this GGUF instead of the default models (repeatable)")
    args = parser.parse_args(argv)
    layouts = args.layouts.split(",")
    if not set(layouts) <= set(LAYOUTS):
        parser.error(f"--layouts {args.layouts!r}: choose from {','.join(LAYOUTS)}")
    gen_tokens, reps = (8, 1) if args.quick else (32, 3)
    models: dict[str, str | None] = dict(m.split("=", 1) for m in args.model) or {"SmolLM2-135M": None}
    if not args.skip_1b and not args.model and args.part in ("decode", "all"):
        from engine import synthetic_1b

        models["synthetic 1B"] = synthetic_1b()
    out = []
    if args.part in ("allreduce", "all"):
        from tp_allreduce import table

        out += table(args.iters) + [""]
        print("\n".join(out), flush=True)
    if args.part in ("decode", "all"):
        out += decode_table(models, (1, 8), gen_tokens, reps, layouts) + [""]
    if args.part in ("topk", "all"):
        out += topk_table({"SmolLM2-135M": None}, gen_tokens, reps)
    print("\n" + "\n".join(out))


if __name__ == "__main__":
    main()
