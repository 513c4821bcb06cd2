"""The fp32 / bf16 weights' GEMM of decode and verification rows (engine/csrc/dense_gemm.cpp, DenseLinear): a row's
output is bit-identical alone and in batches of 1..40 rows at any position (at this process's kernel level and, in a
process of its own, at the AVX2 level), within the rounding bound of its arithmetic of the exact product and of
torch's fp32 matmul, and the layer sends prompt rows to F.linear and the others to it."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cpuserve.engine.config import EngineConfig
from cpuserve.engine.layers import kernel_build, native
from cpuserve.engine.layers.linear import build_linear
from cpuserve.engine.llm import LLM
from cpuserve.engine.spec.drafter import check_rows_verify_exactly

needs_dense = pytest.mark.skipif(not native.dense_gemm_enabled(), reason="dense_gemm is not built here (no AVX2, or "
                                "CPUSERVE_KERNELS=torch): fp32 / bf16 layers run F.linear")
DTYPES = (torch.float32, torch.bfloat16)
# (N, K): inputs past the last whole step (K % 32, % 16, % 8), columns past the last register block and task
# (N % 4, % 16), fewer inputs than one step, SmolLM2's down projection
SHAPES = ((100, 77), (37, 576), (5, 7), (96, 1536))
POOL = 40  # rows to draw batches from
U = 2.0 ** -24  # fp32's unit roundoff


def operands(n: int, k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(POOL, k, generator=gen)
    x[:, k // 3] *= 30  # an outlier channel: large partial sums, so a changed order shows in the low bits
    w = torch.randn(n, k, generator=gen) * 0.05
    b = torch.randn(n, generator=gen)
    return x.to(dtype), w.to(dtype), b.to(dtype)


def gemm(x, w, b):
    return torch.ops.cpuserve.dense_gemm(x, w, b)


@needs_dense
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_a_rows_bits_do_not_depend_on_its_batch_or_place(n, k, dtype):
    x, w, b = operands(n, k, dtype)
    alone = torch.cat([gemm(x[i:i + 1], w, b) for i in range(POOL)])
    gen = torch.Generator().manual_seed(1)
    for m in range(1, POOL + 1):
        rows = torch.randperm(POOL, generator=gen)[:m]  # m rows in a random order: each at some position
        assert torch.equal(gemm(x[rows], w, b), alone[rows]), m
        out = torch.full((m + 2, n), float("nan"), dtype=dtype)
        torch.ops.cpuserve.dense_gemm.out(x[rows], w, b, out=out[1:m + 1])  # rows of a larger output
        assert torch.equal(out[1:m + 1], alone[rows]) and out[0].isnan().all() and out[-1].isnan().all(), m
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # threads split the columns only
        assert torch.equal(gemm(x, w, b), alone)
    finally:
        torch.set_num_threads(threads)


def bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|computed - exact| for each element of x @ w.T + b: each of L lanes sums ceil(K / L) products, one rounding
    each (fma, or vdpbf16ps's add of an exact bf16 product), log2(L) adds sum the lanes, one adds the bias, so with
    n = ceil(K / L) + log2(L) + 1 roundings the error is at most gamma_n (sum |x w| + |b|), gamma_n = n u / (1 - n u)
    (Higham, Accuracy and Stability, 3.1); L = 8 is the worst of the levels (AVX2; AVX-512's are 16)."""
    n = math.ceil(x.shape[1] / 8) + 3 + 1
    gamma = n * U / (1 - n * U)
    return gamma * (x.double().abs() @ w.double().abs().T + b.double().abs())


@needs_dense
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_within_the_rounding_bound_of_the_exact_product_and_of_torchs_fp32_matmul(n, k, dtype):
    x, w, b = operands(n, k, dtype, seed=2)
    got = gemm(x, w, b).double()
    exact = x.double() @ w.double().T + b.double()  # bf16 and fp32 products and sums exact in float64 here
    err = bound(x, w, b)
    if dtype == torch.bfloat16:  # rounded once to bf16 at the end: half an ulp, 2^-8 of the value at most
        err = err + 2.0 ** -8 * (exact.abs() + err)
    assert ((got - exact).abs() <= err).all(), ((got - exact).abs() / err).max()
    # torch's fp32 matmul of the same values sums in some other order: within gamma_K (sum |x w| + |b|) of exact
    theirs = F.linear(x.float(), w.float(), b.float()).double()
    n_torch = k + 1
    theirs_err = n_torch * U / (1 - n_torch * U) * (x.double().abs() @ w.double().abs().T + b.double().abs())
    assert ((got - theirs).abs() <= err + theirs_err).all()


@needs_dense
@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_the_layer_runs_dense_gemm_for_every_row_but_bf16_prompt_rows(fmt):
    """bf16: prompt rows on F.linear (torch's bf16 GEMM is faster at many rows), the others on dense_gemm; fp32:
    every row on dense_gemm (faster than torch's fp32 GEMM at every size measured), prompt rows too."""
    x, w, b = operands(96, 576, torch.float32, seed=3)
    layer = build_linear(w.float(), b.float(), fmt)
    dtype = layer.act_dtype
    xd, wd, bd = x.to(dtype), layer.weight, layer.bias
    ranges = ((3, 9), (20, 33))
    assert layer.has_prompt_kernel() == (fmt == "bf16")
    before = torch.ops.cpuserve.dense_gemm_runs()
    got = layer(xd, prompt_rows=ranges)
    if fmt == "fp32":
        assert torch.ops.cpuserve.dense_gemm_runs() - before == 1 and torch.equal(got, gemm(xd, wd, bd))
    else:
        assert torch.ops.cpuserve.dense_gemm_runs() - before == 3  # the rows before, between and after the ranges
        for a, c in ((0, 3), (9, 20), (33, POOL)):
            assert torch.equal(got[a:c], gemm(xd[a:c], wd, bd))
        for a, c in ranges:
            assert torch.equal(got[a:c], torch.mm(xd[a:c], wd.t()) + bd)  # F.linear's GEMM, then the bias
    assert torch.equal(layer(xd), gemm(xd, wd, bd))  # no prompt rows: every row on dense_gemm
    layer.use_torch_gemm = True  # the plain-torch path (use_fallback): F.linear for every row
    assert not layer.has_prompt_kernel() and torch.equal(layer(xd, prompt_rows=ranges), F.linear(xd, wd, bd))


@needs_dense
def test_the_avx2_level_gives_row_invariant_outputs_too():
    """This file's tests in a process at the lowest level this CPU runs (AVX2: 8 lanes, 16 registers), when this
    process runs another."""
    lowest = kernel_build.runnable_levels(kernel_build.cpu_flags())[-1]
    if lowest.name == native.level().name:
        pytest.skip(f"this process runs the lowest level ({lowest.name}): its tests are this run")
    env = {**os.environ, "CPUSERVE_KERNEL_LEVEL": lowest.name, "CPUSERVE_KERNELS": "native"}
    check = ("from cpuserve.engine.layers import native; import torch; assert native.dense_gemm_enabled(); "
             f"assert native.level().name == {lowest.name!r}; assert torch.ops.cpuserve.dense_gemm_isa() == 'avx2', torch.ops.cpuserve.dense_gemm_isa()")
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", __file__,
                           "-k", "not avx2_level"], env=env, cwd=Path(__file__).parents[2], capture_output=True,
                          text=True, timeout=1800)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and "passed" in summary and "skipped" not in summary, f"{summary}\n{done.stdout[-3000:]}{done.stderr[-2000:]}"


def test_speculation_refuses_fp32_and_bf16_weights_where_dense_gemm_does_not_run(monkeypatch):
    monkeypatch.setattr(native, "dense_gemm_enabled", lambda: False)  # as CPUSERVE_KERNELS=torch or no AVX2 leave it
    for weights in ("fp32", "bf16"):
        with pytest.raises(ValueError, match=f"speculative='ngram' with weights='{weights}' needs .*dense_gemm"):
            LLM(weights=weights, speculative="ngram", kv_cache_gb=0.05, show_progress=False)
    check_rows_verify_exactly(EngineConfig(weights="int4", speculative="ngram"))  # int4 / int8: every row alone
    check_rows_verify_exactly(EngineConfig(weights="bf16"))  # no speculation: F.linear is fine
