"""llama.cpp's own GEMM timing, `test-backend-ops perf`, as a peer column of bench/kernel_levels.py.

test-backend-ops' perf cases include MUL_MAT of every weight type at 4096 outputs x 14336 inputs and n = 1, 2, 3, 4,
5, 8, 512 activation rows (f32). It times a graph of the same op repeated for at least a second, on the CPU backend
only when asked (`-b CPU`), with max(1, hardware_concurrency / 2) threads: that count is fixed in its source, so
the cpuserve side must run as many. Build it for one x86 level with that level's GGML_* options and
GGML_NATIVE=OFF; the binary and its libggml-cpu then run that level whatever the CPU has.
"""
from __future__ import annotations

import os
import re
import subprocess

LINE = re.compile(r"MUL_MAT\(type_a=(?P<type>\w+),type_b=f32,m=(?P<m>\d+),n=(?P<n>\d+),k=(?P<k>\d+),[^)]*\):"
                  r"\s+(?P<runs>\d+) runs -\s+(?P<us>[\d.]+) us/run")


def threads() -> int:
    """The threads test-backend-ops gives the backend on this machine (its N_THREADS / 2)."""
    return max(1, (os.cpu_count() or 1) // 2)


def ggml_type(gguf_name: str) -> str:
    """ggml's spelling of a type in test case names: Q4_1 -> q4_1, Q4_K -> q4_K."""
    return gguf_name.lower().replace("_k", "_K")


def perf_command(binary: str, gguf_name: str, n: int, k: int, rows: int) -> list[str]:
    """test-backend-ops timing one MUL_MAT case: weights [n outputs, k inputs] of the type, `rows` activation rows
    (its m, n, k are outputs, rows, inputs)."""
    case = f"type_a={ggml_type(gguf_name)},type_b=f32,m={n},n={rows},k={k},"  # the comma: n=8 must not match n=80
    return [binary, "perf", "-b", "CPU", "-o", "MUL_MAT", "-p", re.escape(case)]


def parse_perf(text: str) -> dict[tuple[str, int, int, int], float]:
    """Milliseconds a run of each MUL_MAT case in test-backend-ops' console output, keyed (type, m, n, k)."""
    out = {}
    for match in LINE.finditer(text):
        key = (match["type"], int(match["m"]), int(match["n"]), int(match["k"]))
        out[key] = float(match["us"]) / 1e3
    return out


def time_ms(binary: str, gguf_name: str, n: int, k: int, rows: int) -> float:
    """Milliseconds a call of llama.cpp's MUL_MAT at this shape, as test-backend-ops times it."""
    proc = subprocess.run(perf_command(binary, gguf_name, n, k, rows), capture_output=True, text=True, check=True)
    key = (ggml_type(gguf_name), n, rows, k)
    times = parse_perf(proc.stdout)
    if key not in times:
        raise RuntimeError(f"{binary} printed no time for MUL_MAT {key} (not a perf case?):\n{proc.stdout[-2000:]}")
    return times[key]
