"""Micro-benchmark of QuantLinear formats against an fp32 F.linear.

    python bench/linear.py [--n 5632 --k 2048 --rows 1 32 --repeats 30]

Prints median milliseconds per call and the speed-up over fp32 F.linear (higher is faster).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from attention import median_ms  # bench/ is on sys.path when a bench script runs
from cpuserve.engine.layers.quant_linear import QuantLinear

FORMATS = ("int4", "int8", "bf16", "fp32")


@torch.inference_mode()
def run(n: int = 5632, k: int = 2048, rows: tuple[int, ...] = (1, 32), repeats: int = 30,
        group_size: int = 32) -> list[dict]:
    """One row per (M, format): median ms and the ratio fp32_F.linear_ms / ms."""
    weight = torch.randn(n, k) * 0.02
    mods = {fmt: QuantLinear.from_float(weight, None, fmt, group_size) for fmt in FORMATS}
    results = []
    for m in rows:
        x = torch.randn(m, k)
        base = median_ms(lambda: F.linear(x, weight), repeats)
        for fmt, mod in mods.items():
            xin = x.to(mod.act_dtype)  # the engine hands each layer activations already in its dtype
            ms = median_ms(lambda: mod(xin), repeats)
            results.append({"bench": "linear", "shape": f"{n}x{k}", "M": m, "format": fmt,
                            "ms": round(ms, 4), "speedup_vs_fp32": round(base / ms, 2),
                            "GB/s": round(mod_bytes(mod) / ms / 1e6, 1)})
    return results


def mod_bytes(mod: QuantLinear) -> int:
    return sum(b.numel() * b.element_size() for b in mod.buffers())


def print_table(rows: list[dict]) -> None:
    cols = list(rows[0])
    print(" | ".join(f"{c:>15}" for c in cols))
    for r in rows:
        print(" | ".join(f"{str(r[c]):>15}" for c in cols))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=5632)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print_table(run(a.n, a.k, tuple(a.rows), a.repeats, a.group_size))
