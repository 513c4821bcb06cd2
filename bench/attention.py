"""Attention micro-benchmarks (SmolLM2 shape: 9 heads, 3 kv heads, head_dim 64).

    python bench/attention.py [--quick] [--repeats 5]
    python bench/attention.py --products      # which product kernel SlimAttention should take on this CPU

Prefill: SlimAttention vs torch SDPA (is_causal=True, enable_gqa=True: torch's CPU flash kernel) at 1024 and
4096 tokens, bf16 and fp32; ratio = sdpa_ms / slim_ms (> 1: SlimAttention is faster). The two run interleaved, one
call each per repetition, so drift from other load on the machine hits both alike. The case names the kernel:
"native brgemm" / "native avx512_bf16" (engine/csrc/slim_attention.cpp), "native fp32" (slim_attention_fp32.cpp)
or "torch" (attention.slim_attention); "prefill fp32" rows time the fp32 kernel against that plain-torch path
(ratio = torch_ms / native_ms), which fp32 prefill ran before the kernel;
"int8 K" is the engine's prefill with int8 activations where the kernel runs Q K^T as int8 dot products (AVX-512
VNNI without AMX: engine/csrc/int8_scores.h), on K as the int8 pool holds it.
"prefill products" rows time each product kernel the CPU runs (AMX's brgemm, avx512_bf16, and Q K^T in int8 on it)
against the one the engine chooses here, at 128, 512 and 2048 tokens; ratio = engine_ms / this_ms (> 1: the engine
would gain from this kernel at that length).
Decode: paged_decode_attention with an int8 vs a bf16 cache at batch 1/8/32, context 512;
ratio = bf16_ms / int8_ms. Then the fused C++ kernel (torch.ops.cpuserve.decode_attention) against that
plain-torch kernel on the same int8 pool; ratio = torch_ms / native_ms.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from cpuserve.engine.layers import native
from cpuserve.engine.threads import tune_allocator as tune_malloc  # the engine's own setting, applied the same way
from cpuserve.engine.layers.attention import (DECODE_CHUNK_TOKENS, SLIM_BLOCK_ROWS, paged_decode_attention,
                                              quantize_kv, slim_attention, write_kv)
from cpuserve.engine.layers.ops import NATIVE_SLIM_BLOCK_ROWS

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
PRODUCT_LENS = (128, 512, 2048)  # a served burst's short prompts, the engine bench's prompt, a long one


def median_ms(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def interleaved_median_ms(fns, repeats: int, warmup: int = 1) -> list[float]:
    """Median ms of each of fns, timed one call each in turn per repetition."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [1000 * statistics.median(ts) for ts in times]


def bench_prefill(seq_len: int, dtype: torch.dtype, repeats: int, block_rows: int | None = None,
                  int8_keys: bool = False) -> dict:
    """SlimAttention as the engine runs it (the C++ kernel for bf16 when it runs on this CPU) against SDPA.
    int8_keys: K as the int8 pool holds it, Q K^T as int8 dot products (the engine's way with int8 activations
    where native.slim_attention_int8_keys()); SDPA gets the bf16 keys the codes were made from."""
    fused = native_prefill(dtype)
    block_rows = block_rows or (NATIVE_SLIM_BLOCK_ROWS if fused else SLIM_BLOCK_ROWS)
    q = torch.randn(seq_len, HEADS, HEAD_DIM).to(dtype)
    k = torch.randn(seq_len, KV_HEADS, HEAD_DIM).to(dtype)
    v = torch.randn(seq_len, KV_HEADS, HEAD_DIM).to(dtype)
    codes, k_scale = quantize_kv(k) if int8_keys else (k, None)
    scale = HEAD_DIM ** -0.5
    qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, L, D]: SDPA's layout
    def sdpa_fn():
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)

    def slim_fn():
        if fused:
            return torch.ops.cpuserve.slim_attention(q, codes, v, 0, scale, block_rows, 0, k_scale)
        return slim_attention(q, codes, v, 0, scale, block_rows=block_rows, k_scale=k_scale)

    sdpa, slim = interleaved_median_ms([sdpa_fn, slim_fn], repeats)
    kind = "torch" if not fused else "native fp32" if dtype == torch.float32 else \
        f"native {torch.ops.cpuserve.slim_attention_kernel()}"
    kind += " int8 K" if int8_keys else ""
    return {"bench": "prefill", "case": f"L={seq_len} {str(dtype)[6:]} {kind} rows={block_rows}",
            "base_ms": round(sdpa, 2), "ours_ms": round(slim, 2), "ratio": round(sdpa / slim, 2),
            "vs": "sdpa/slim"}


def bench_products(seq_len: int, repeats: int) -> list[dict]:
    """SlimAttention's product kernels that this CPU runs (brgemm: AMX-BF16; avx512_bf16, and on it Q K^T as int8 dot
    products on the int8 pool's K codes), each timed against the one the engine takes here (slim_attention_products'
    automatic choice, with an int8 K where the engine gives it one), interleaved. ratio = engine_ms / this_ms: above
    1, this kernel would be faster than the engine's choice at this prompt length."""
    if not native.slim_attention_native_enabled():
        return []
    q, k, v = (torch.randn(seq_len, h, HEAD_DIM).to(torch.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS))
    codes, k_scale = quantize_kv(k)
    scale = HEAD_DIM ** -0.5
    chosen = torch.ops.cpuserve.slim_attention_products("auto")
    engine = (chosen, native.slim_attention_int8_keys())
    variants = []
    for mode in ("brgemm", "avx512_bf16"):
        try:
            torch.ops.cpuserve.slim_attention_products(mode)
        except RuntimeError:  # this CPU (or build) has not got it
            continue
        variants += [(mode, False)] + ([(mode, True)] if torch.ops.cpuserve.slim_attention_int8_keys() else [])
    torch.ops.cpuserve.slim_attention_products("auto")

    def call(mode: str, int8_keys: bool):
        def fn():
            torch.ops.cpuserve.slim_attention_products(mode)
            return torch.ops.cpuserve.slim_attention(q, codes if int8_keys else k, v, 0, scale,
                                                     NATIVE_SLIM_BLOCK_ROWS, 0, k_scale if int8_keys else None)
        return fn

    others = [variant for variant in variants if variant != engine]
    try:
        engine_ms, *times = interleaved_median_ms([call(*engine)] + [call(*variant) for variant in others], repeats)
    finally:
        torch.ops.cpuserve.slim_attention_products("auto")
    label = lambda mode, int8_keys: mode + (" int8 K" if int8_keys else "")  # noqa: E731
    return [{"bench": "prefill products", "case": f"L={seq_len} {label(*variant)}", "base_ms": round(engine_ms, 3),
             "ours_ms": round(ms, 3), "ratio": round(engine_ms / ms, 2), "vs": f"engine's ({label(*engine)})/this"}
            for variant, ms in zip(others, times)]


def native_prefill(dtype: torch.dtype) -> bool:
    """The engine's prefill of this dtype runs the C++ SlimAttention here (ops.prefill_attention's choice)."""
    if dtype == torch.bfloat16:
        return native.slim_attention_native_enabled()
    return dtype == torch.float32 and native.slim_attention_fp32_enabled()


def bench_prefill_fp32_paths(seq_len: int, repeats: int, block_rows: int | None = None) -> dict:
    """fp32 prefill: the C++ kernel against the plain-torch SlimAttention, interleaved."""
    block_rows = block_rows or NATIVE_SLIM_BLOCK_ROWS
    q, k, v = (torch.randn(seq_len, h, HEAD_DIM) for h in (HEADS, KV_HEADS, KV_HEADS))
    scale = HEAD_DIM ** -0.5
    plain, fused = interleaved_median_ms(
        [lambda: slim_attention(q, k, v, 0, scale),
         lambda: torch.ops.cpuserve.slim_attention(q, k, v, 0, scale, block_rows, 0, None)], repeats)
    return {"bench": "prefill fp32", "case": f"L={seq_len} rows={block_rows}", "base_ms": round(plain, 2),
            "ours_ms": round(fused, 2), "ratio": round(plain / fused, 2), "vs": "torch/native"}


def make_pool(cache_dtype: torch.dtype, batch: int, context: int):
    """K and V views of one pool [num_blocks, B, 2 Hkv, D] as the engine lays it out, shuffled block tables, and
    the pool and its scales themselves (what the fused kernel reads; a view's _base is unset in inference mode)."""
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq + 1
    pool = torch.zeros(num_blocks, BLOCK_SIZE, 2 * KV_HEADS, HEAD_DIM, dtype=cache_dtype)
    k_cache, v_cache = pool[:, :, :KV_HEADS], pool[:, :, KV_HEADS:]
    scales, scale = (None, None), None
    if cache_dtype == torch.int8:
        scale = torch.zeros(pool.shape[:3])
        scales = (scale[..., :KV_HEADS], scale[..., KV_HEADS:])
    tables = (torch.randperm(num_blocks - 1)[: batch * blocks_per_seq] + 1).view(batch, blocks_per_seq)
    slots = (tables.repeat_interleave(BLOCK_SIZE, 1) * BLOCK_SIZE + torch.arange(context) % BLOCK_SIZE).view(-1)
    kv = torch.randn(batch * context, KV_HEADS, HEAD_DIM)
    write_kv(k_cache, scales[0], v_cache, scales[1], kv, kv, slots)
    return (k_cache, scales[0], v_cache, scales[1]), tables.to(torch.int32), (pool, scale)


def bench_decode(batch: int, context: int, repeats: int, chunk_tokens: int) -> dict:
    q = torch.randn(batch, HEADS, HEAD_DIM).to(torch.bfloat16)
    lens = torch.full((batch,), context, dtype=torch.int32)
    ms = {}
    for dtype in (torch.int8, torch.bfloat16):
        cache, tables, _ = make_pool(dtype, batch, context)
        ms[dtype] = median_ms(lambda: paged_decode_attention(q, *cache, tables, lens, HEAD_DIM ** -0.5,
                                                             chunk_tokens=chunk_tokens), repeats, warmup=3)
    return {"bench": "decode", "case": f"S={batch} ctx={context} chunk={chunk_tokens}",
            "base_ms": round(ms[torch.bfloat16], 3), "ours_ms": round(ms[torch.int8], 3),
            "ratio": round(ms[torch.bfloat16] / ms[torch.int8], 2), "vs": "bf16/int8"}


def bench_native_decode(batch: int, context: int, repeats: int) -> dict:
    q = torch.randn(batch, HEADS, HEAD_DIM).to(torch.bfloat16)
    lens = torch.full((batch,), context, dtype=torch.int32)
    cache, tables, (pool, scale) = make_pool(torch.int8, batch, context)
    plain = median_ms(lambda: paged_decode_attention(q, *cache, tables, lens, HEAD_DIM ** -0.5), repeats, warmup=3)
    fused = median_ms(lambda: torch.ops.cpuserve.decode_attention(q, pool, scale, tables, lens, HEAD_DIM ** -0.5),
                      repeats, warmup=3)
    return {"bench": "decode int8", "case": f"S={batch} ctx={context}", "base_ms": round(plain, 3),
            "ours_ms": round(fused, 3), "ratio": round(plain / fused, 2), "vs": "torch/native"}


@torch.inference_mode()
def run(prefill_lens=(1024, 4096), dtypes=(torch.bfloat16, torch.float32), batches=(1, 8, 32), context=512,
        repeats: int = 5, block_rows: int | None = None, chunk_tokens: int = DECODE_CHUNK_TOKENS,
        prefill_only: bool = False, products: bool = False) -> list[dict]:
    """Rows of {bench, case, base_ms, ours_ms, ratio, vs}; medians of `repeats` runs. products: also the product
    kernels' rows (bench_products, at PRODUCT_LENS)."""
    rows = [bench_prefill(n, dt, repeats, block_rows) for n in prefill_lens for dt in dtypes]
    if torch.float32 in dtypes and native_prefill(torch.float32):
        rows += [bench_prefill_fp32_paths(n, repeats, block_rows) for n in prefill_lens]
    if torch.bfloat16 in dtypes and native.slim_attention_int8_keys():
        rows += [bench_prefill(n, torch.bfloat16, repeats, block_rows, int8_keys=True) for n in prefill_lens]
    if products:
        rows += [row for n in PRODUCT_LENS for row in bench_products(n, max(repeats, 20))]
    if prefill_only:
        return rows
    rows += [bench_decode(b, context, max(repeats, 20), chunk_tokens) for b in batches]
    if native.available():
        rows += [bench_native_decode(b, context, max(repeats, 20)) for b in batches]
    return rows


def print_table(rows: list[dict]) -> None:
    if not rows:
        print("no rows: the C++ SlimAttention does not run for bf16 on this CPU (neither AMX nor AVX512-BF16)")
        return
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in cols))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="1024-token prefill only")
    ap.add_argument("--prefill", action="store_true", help="bf16 prefill only (the SlimAttention ratio table)")
    ap.add_argument("--fp32", action="store_true", help="fp32 prefill only (the fp32 kernel against the torch path)")
    ap.add_argument("--products", action="store_true",
                    help="only the product kernels this CPU runs against the engine's choice (also in a full run)")
    ap.add_argument("--block-rows", type=int, default=None, help="SlimAttention row block (default: the engine's)")
    ap.add_argument("--chunk-tokens", type=int, default=DECODE_CHUNK_TOKENS)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--no-malloc-tuning", action="store_true", help="leave glibc malloc at its defaults")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    tuned = not a.no_malloc_tuning and tune_malloc()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, malloc tuned: {tuned}")
    lens = (1024,) if a.quick else (1024, 4096)
    dtypes = (torch.float32,) if a.fp32 else (torch.bfloat16,) if a.prefill else (torch.bfloat16, torch.float32)
    if a.products:
        print_table([row for n in PRODUCT_LENS for row in bench_products(n, max(a.repeats, 20))])
    else:
        print_table(run(prefill_lens=lens, dtypes=dtypes, repeats=a.repeats, block_rows=a.block_rows,
                        chunk_tokens=a.chunk_tokens, prefill_only=a.prefill or a.fp32,
                        products=not (a.quick or a.prefill or a.fp32)))
