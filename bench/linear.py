"""Micro-benchmarks of QuantLinear: formats against an fp32 F.linear, and our int4 / int8 GEMMs against torch's.

    python bench/linear.py [--n 5632 --k 2048 --rows 1 32 --repeats 30]
    python bench/linear.py --kernels [--rows 1 2 4 8 16 24 32]   # SmolLM2's and a 1B's layer shapes
    python bench/linear.py --int8-activations [--rows 1 8 32 128 512]
    python bench/linear.py --dense [--rows 1 5 8 20]   # fp32 / bf16 weights: dense_gemm against F.linear

Prints median milliseconds per call and the speed-up over fp32 F.linear (higher is faster). --kernels times our
kernel (engine/csrc, with out=) and torch's (_weight_int4pack_mm_for_cpu / _weight_int8pack_mm) call for call,
interleaved, so drift on a shared machine hits both alike; the ratio is torch's median / ours (> 1: ours faster).
--int8-activations times the int8 dot-product GEMMs (activations="int8", vnni_gemm.cpp) against our bf16-activation
GEMMs on the same shapes, interleaved: ratio = bf16_ms / int8_ms, and the int8 kernel's multiply-adds per cycle
per thread (the roofline: AVX-512 VNNI issues one 64-MAC vpdpbusd per cycle on Zen 4, two on Sapphire Rapids).
--dense times the fp32 / bf16 weights' row-invariant GEMM (dense_gemm.cpp, the decode and verification rows) against
F.linear (what those rows ran before) on SmolLM2's shapes, interleaved: ratio = F.linear_ms / ours_ms (> 1: ours
faster), and the weight bytes streamed per second by ours.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from attention import median_ms  # bench/ is on sys.path when a bench script runs
from cpuserve.engine.config import WEIGHT_FORMATS as FORMATS
from cpuserve.engine.layers import native
from cpuserve.engine.layers.linear import QuantLinear, build_linear


@torch.inference_mode()
def run(n: int = 5632, k: int = 2048, rows: tuple[int, ...] = (1, 32), repeats: int = 30,
        group_size: int = 32) -> list[dict]:
    """One row per (M, format): median ms and the ratio fp32_F.linear_ms / ms."""
    weight = torch.randn(n, k) * 0.02
    mods = {fmt: build_linear(weight, None, fmt, group_size) for fmt in FORMATS}
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


# (N, K) per layer: SmolLM2-135M (qkv, o, gate+up, down), a TinyLlama-shaped 1B (o, gate+up, down), int8 lm_head
KERNEL_SHAPES = {"int4": [(960, 576), (576, 576), (3072, 576), (576, 1536), (2048, 2048), (11264, 2048), (2048, 5632)],
                 "int8": [(960, 576), (576, 1536), (2048, 2048), (49152, 576)]}


@torch.inference_mode()
def run_kernels(rows: tuple[int, ...], fmts=("int4", "int8"), budget_s: float = 0.4) -> list[dict]:
    """Our GEMM against torch's kernel on the same weights, interleaved call for call; checks equal bits too."""
    if not (native.int4_gemm_enabled() and native.int8_gemm_enabled()):
        raise SystemExit("our GEMMs are not built or not enabled here (CPUSERVE_KERNELS, AVX-512): nothing to compare")
    results = []
    for fmt in fmts:
        for n, k in KERNEL_SHAPES[fmt]:
            mod = build_linear(torch.randn(n, k) * 0.02, None, fmt, 32)
            for m in rows:
                x = torch.randn(m, k).to(torch.bfloat16)
                out = torch.empty(m, n, dtype=torch.bfloat16)
                if fmt == "int4":
                    args = (x, mod.packed, 32, mod.scales_and_zeros)
                    theirs = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(*args)  # noqa: E731
                    ours = lambda: torch.ops.cpuserve.int4_gemm.out(*args, out=out)  # noqa: E731
                else:
                    args = (x, mod.weight_int8, mod.scales)
                    theirs = lambda: torch._weight_int8pack_mm(*args)  # noqa: E731
                    ours = lambda: torch.ops.cpuserve.int8_gemm.out(*args, out=out)  # noqa: E731
                assert torch.equal(ours(), theirs()), f"{fmt} {n}x{k}, {m} rows: not torch's bits"
                a, b = interleaved_ms(theirs, ours, budget_s)
                results.append({"bench": "kernels", "format": fmt, "shape": f"{n}x{k}", "M": m, "torch_ms": round(a, 4),
                                "ours_ms": round(b, 4), "ours_vs_torch": round(a / b, 2)})
                print(" | ".join(f"{v!s:>12}" for v in results[-1].values()), flush=True)
    return results


DENSE_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # SmolLM2: qkv, o, gate_up, down, lm_head


@torch.inference_mode()
def run_dense(rows: tuple[int, ...], budget_s: float = 0.4) -> list[dict]:
    """dense_gemm (with out=) against F.linear on the same weights and rows, interleaved; both dtypes."""
    if not native.dense_gemm_enabled():
        raise SystemExit("dense_gemm is not built or not enabled here (CPUSERVE_KERNELS, a CPU without AVX2)")
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for n, k in DENSE_SHAPES:
            w = (torch.randn(n, k) * 0.02).to(dtype)
            for m in rows:
                x = torch.randn(m, k).to(dtype)
                out = torch.empty(m, n, dtype=dtype)
                a, b = interleaved_ms(lambda: F.linear(x, w),
                                      lambda: torch.ops.cpuserve.dense_gemm.out(x, w, None, out=out), budget_s)
                results.append({"dtype": str(dtype).removeprefix("torch."), "shape": f"{n}x{k}", "M": m,
                                "torch_ms": round(a, 4), "ours_ms": round(b, 4), "ours_vs_torch": round(a / b, 2),
                                "GB/s": round(w.numel() * w.element_size() / b / 1e6, 1)})
                print(" | ".join(f"{v!s:>12}" for v in results[-1].values()), flush=True)
    return results


def interleaved_ms(a, b, budget_s: float) -> tuple[float, float]:
    """Median ms of a() and b(), called alternately for budget_s (at least 10 each)."""
    t_a, t_b = [], []
    deadline = time.perf_counter() + budget_s
    while time.perf_counter() < deadline or len(t_a) < 10:
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        t_a.append(t1 - t0)
        t_b.append(time.perf_counter() - t1)
    return statistics.median(t_a) * 1e3, statistics.median(t_b) * 1e3


def cpu_ghz() -> float:
    with open("/proc/cpuinfo") as f:
        mhz = [float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")]
    return (max(mhz) if mhz else 0.0) / 1e3


@torch.inference_mode()
def run_int8_activations(rows: tuple[int, ...], budget_s: float = 0.4) -> list[dict]:
    """int8 dot products against bf16 activations (our GEMMs, each with out=) on the engine's layer shapes."""
    if not native.vnni_gemm_enabled():
        raise SystemExit("the VNNI GEMMs are not built here (CPUSERVE_KERNELS, a CPU without AVX-512 VNNI)")
    ghz, threads, results = cpu_ghz(), torch.get_num_threads(), []
    for fmt in ("int4", "int8"):
        for n, k in KERNEL_SHAPES[fmt]:
            w = torch.randn(n, k) * 0.02
            bf16, int8 = (build_linear(w, None, fmt, 32, activations=a) for a in ("bf16", "int8"))
            for m in rows:
                x = torch.randn(m, k).to(torch.bfloat16)
                out = torch.empty(m, n, dtype=torch.bfloat16)
                a, b = interleaved_ms(lambda: bf16(x, out=out), lambda: int8(x, out=out), budget_s)
                macs = m * n * k / (b * 1e-3) / 1e9  # GMAC/s of the int8 kernel
                results.append({"format": fmt, "shape": f"{n}x{k}", "M": m, "bf16_ms": round(a, 4),
                                "int8_ms": round(b, 4), "int8_vs_bf16": round(a / b, 2),
                                "MAC/cycle/thread": round(macs / (ghz * threads), 1) if ghz else "?"})
                print(" | ".join(f"{v!s:>12}" for v in results[-1].values()), flush=True)
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
    ap.add_argument("--rows", type=int, nargs="+", help="default: 1 32; with --kernels 1 2 4 8 16 24 32")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--kernels", action="store_true", help="our int4 / int8 GEMMs against torch's kernels")
    ap.add_argument("--int8-activations", action="store_true", help="int8 dot products against bf16 activations")
    ap.add_argument("--dense", action="store_true", help="fp32 / bf16 weights: dense_gemm against F.linear")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if a.int8_activations:
        print(f"CPU clock {cpu_ghz():.2f} GHz (/proc/cpuinfo)")
        print("      format |        shape |            M |      bf16_ms |      int8_ms | int8_vs_bf16 | MAC/cycle/thread")
        run_int8_activations(tuple(a.rows or (1, 8, 32, 128, 512)))
    elif a.dense:
        print("       dtype |        shape |            M |     torch_ms |      ours_ms | ours_vs_torch |         GB/s")
        run_dense(tuple(a.rows or (1, 5, 8, 20)))
    elif a.kernels:
        print("      format |        shape |            M |     torch_ms |      ours_ms | ours_vs_torch")
        run_kernels(tuple(a.rows or (1, 2, 4, 8, 16, 24, 32)))
    else:
        print_table(run(a.n, a.k, tuple(a.rows or (1, 32)), a.repeats, a.group_size))
