"""The int8-activation GEMMs at each kernel level this CPU runs, in one run: a worker process per level (a process loads
one level's library: CPUSERVE_KERNEL_LEVEL), each shape and row count timed at every level in turn, so the machine's
drift hits the levels alike.

    python bench/kernel_levels.py [--levels avx512_bf16 avx2] [--formats q4_1 q8_0 q4_k q6_k]
                                  [--shapes smollm2 llama8b] [--rows 1 8 512] [--threads 2] [--rounds 3]
                                  [--llama-test-backend-ops [NAME=]PATH ...]

Weights are a GGUF's own blocks (gguf's quantizer for Q4_0 / Q4_1 / Q8_0, valid random blocks for the K-quants), kept
as codes: what the engine multiplies by default (activations="int8"). Prints, per format, shape and row count, the
median milliseconds per call of each level, its G multiply-adds a second, and its speed against the first level's.
`llama8b` is llama.cpp's test-backend-ops MUL_MAT perf shape (4096 outputs x 14336 inputs), so its GFLOPS (2 per
multiply-add) compare directly:  test-backend-ops perf -b CPU -o MUL_MAT -p "type_a=q4_1,type_b=f32,m=4096,n=8,k=14336".
`--llama-test-backend-ops` adds such a binary (one per llama.cpp build, e.g. one built for AVX2 only) as a column
timed in the same run, llama8b shape only, with the threads it runs (bench/peer_llama_ops.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import peer_llama_ops

SHAPES = {  # (N outputs, K inputs) per GEMM
    "smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536)],  # qkv, o, gate_up, down
    "llama1b": [(2048, 2048), (11264, 2048), (2048, 5632)],
    "llama8b": [(4096, 14336)],
}
FORMATS = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q8_0": "Q8_0", "q4_k": "Q4_K", "q6_k": "Q6_K"}
BLOCK = {"q4_k": 256, "q6_k": 256}  # inputs per block (K must be a multiple); 32 for the others


def worker() -> None:
    """Reads one JSON request a line ({fmt, n, k, rows, budget_s}), answers {rows: median ms} a line."""
    from cpuserve.engine.threads import reexec_with_intel_openmp

    reexec_with_intel_openmp()  # what `cpuserve serve` runs (before torch is imported)
    import torch

    from cpuserve.engine.layers import native

    layers: dict[tuple, torch.nn.Module] = {}
    print(json.dumps({"level": native.level().name, "isa": native.vnni_gemm_isa(),
                      "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        key = (req["fmt"], req["n"], req["k"])
        if key not in layers:
            layers.clear()  # one weight at a time: an 8B-shaped one is tens of MB
            layers[key] = build(*key)
        layer = layers[key]
        ms = {}
        with torch.inference_mode():
            for rows in req["rows"]:
                x = torch.randn(rows, req["k"], generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
                out = torch.empty(rows, req["n"], dtype=torch.bfloat16)
                ms[rows] = median_ms(lambda: layer(x, out=out), req["budget_s"])
        print(json.dumps(ms), flush=True)


def build(fmt: str, n: int, k: int):
    """An Int8ActLinear over a GGUF tensor's own blocks of type FORMATS[fmt], [n, k]."""
    import gguf
    import numpy as np

    from cpuserve.engine.layers.linear import build_linear
    from cpuserve.engine.loader.gguf_codes import decode_codes

    qtype = gguf.GGMLQuantizationType[FORMATS[fmt]]
    rng = np.random.default_rng(0)
    if fmt in ("q4_0", "q4_1", "q8_0"):
        raw = gguf.quants.quantize(rng.normal(0, 0.02, size=(n, k)).astype(np.float32), qtype)
    else:
        sys.path.insert(0, os.path.dirname(__file__))
        from kquant_recipe import random_blocks

        raw = random_blocks(qtype, (n, k), rng)
    return build_linear(decode_codes(raw, qtype, (n, k)), None, "int8" if fmt == "q8_0" else "int4",
                        activations="int8")


def median_ms(call, budget_s: float) -> float:
    call()  # warm: caches, the thread pool, the layer's first scratch
    times = []
    deadline = time.perf_counter() + budget_s
    while time.perf_counter() < deadline or len(times) < 5:
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def start_workers(levels: list[str], threads: int) -> dict[str, subprocess.Popen]:
    env = {**os.environ, "CPUSERVE_KERNELS": "native"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    workers = {}
    for level in levels:
        workers[level] = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True,
                                          env={**env, "CPUSERVE_KERNEL_LEVEL": level})
        hello = json.loads(workers[level].stdout.readline())
        print(f"{level}: int8 GEMMs on {hello['isa']}, {hello['threads']} threads", flush=True)
    return workers


def time_level(worker: subprocess.Popen, fmt: str, n: int, k: int, rows: int, budget_s: float) -> float:
    worker.stdin.write(json.dumps({"fmt": fmt, "n": n, "k": k, "rows": [rows], "budget_s": budget_s}) + "\n")
    worker.stdin.flush()
    return json.loads(worker.stdout.readline())[str(rows)]


def parse_llama(specs: list[str]) -> dict[str, str]:
    """[NAME=]PATH -> {name: path}; the name defaults to the build folder (PATH's bin/'s parent)."""
    named = [spec.split("=", 1) if "=" in spec else [None, spec] for spec in specs]
    return {name or "llama:" + os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(path)))): path
            for name, path in named}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", nargs="+", help="default: every level this CPU runs, best first")
    ap.add_argument("--formats", nargs="+", default=["q4_1", "q8_0", "q4_k", "q6_k"], choices=list(FORMATS))
    ap.add_argument("--shapes", nargs="+", default=["smollm2"], choices=list(SHAPES))
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32, 512])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: the process's cores, or "
                                                           "test-backend-ops' count when it runs)")
    ap.add_argument("--budget", type=float, default=0.3, help="seconds of calls per level, shape and row count")
    ap.add_argument("--rounds", type=int, default=1, help="time each row this many times, every column in turn; "
                                                          "a cell is its rounds' median")
    ap.add_argument("--llama-test-backend-ops", nargs="+", default=[], metavar="[NAME=]PATH",
                    help="llama.cpp's test-backend-ops binaries to time beside the levels (llama8b shape)")
    ap.add_argument("--json", help="write the rows here too")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker()
    from cpuserve.engine.layers import kernel_build

    levels = a.levels or [lv.name for lv in kernel_build.runnable_levels(kernel_build.cpu_flags())]
    llama = parse_llama(a.llama_test_backend_ops)
    if llama:
        if "llama8b" not in a.shapes or a.threads not in (0, peer_llama_ops.threads()):
            ap.error(f"test-backend-ops times the llama8b shape on {peer_llama_ops.threads()} threads here")
        a.threads = peer_llama_ops.threads()
        print(f"{', '.join(llama)}: test-backend-ops, {a.threads} threads", flush=True)
    workers = start_workers(levels, a.threads)
    columns = levels + list(llama)
    width = {c: max(17, len(c) + 3) for c in columns}
    print(f"{'format':>6} {'N x K':>12} {'M':>4} | " + " | ".join(f"{c + ' ms':>{width[c]}} {'GMAC/s':>7} {'x':>5}"
                                                              for c in columns))
    results = []
    for fmt in a.formats:
        for n, k in [s for name in a.shapes for s in SHAPES[name]]:
            if k % BLOCK.get(fmt, 32):
                print(f"{fmt:>6} {f'{n}x{k}':>12}: K is not a multiple of the type's {BLOCK[fmt]}-input blocks")
                continue
            peers = llama if (n, k) in SHAPES["llama8b"] else {}
            for rows in a.rows:
                runs = {c: [] for c in levels + list(peers)}
                for _ in range(a.rounds):  # each column in turn, row count by row count
                    for level in levels:
                        runs[level].append(time_level(workers[level], fmt, n, k, rows, a.budget))
                    for name, path in peers.items():
                        runs[name].append(peer_llama_ops.time_ms(path, FORMATS[fmt], n, k, rows))
                ms = {c: statistics.median(t) for c, t in runs.items()}
                first = ms[levels[0]]
                cells = [f"{ms[c]:>{width[c]}.4f} {rows * n * k / ms[c] / 1e6:>7.1f} {first / ms[c]:>5.2f}"
                         for c in ms]
                print(f"{fmt:>6} {f'{n}x{k}':>12} {rows:>4} | " + " | ".join(cells), flush=True)
                results.append({"format": fmt, "N": n, "K": k, "M": rows, "ms": ms, "runs": runs})
    for w in workers.values():
        w.stdin.close()
        w.wait()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)

if __name__ == "__main__":
    main()
