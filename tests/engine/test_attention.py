"""SlimAttention and paged decode attention against the plain reference; KV cache quantization and I/O."""
import pytest
import torch

from cpuserve.engine.layers import native
from cpuserve.engine.layers.attention import (gather_kv, paged_decode_attention, quantize_kv,
                                              reference_attention, slim_attention, write_kv)


def native_slim(q, k, v, q_start, scale, block_rows):
    """The C++ SlimAttention of q's dtype; skips where the engine runs slim_attention (tested too) for it instead."""
    assert native.available(), "the fused kernels must build here (gcc and ninja are installed by the project)"
    if q.dtype == torch.float32 and not native.slim_attention_fp32_enabled():
        pytest.skip("this kernel level has no AVX-512, so the C++ SlimAttention takes no fp32 here")
    if q.dtype == torch.bfloat16 and not native.slim_attention_native_enabled():
        pytest.skip("this CPU has neither AMX nor AVX512-BF16, so the C++ SlimAttention is not used here")
    return torch.ops.cpuserve.slim_attention(q, k, v, q_start, scale, block_rows)

# fp32: same math, different summation order. bf16: the result is rounded to bf16 (2^-9 relative of values
# that are convex combinations of N(0,1) entries, so |out| < ~4).
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# int8 KV vs the unquantized truth: half a step (absmax/254) per element; on N(0,1) data the attention output
# moves by ~1e-2 at most (measured ~1.2e-2 worst over these shapes), so 4e-2 is a loose but meaningful bound
# (a missing k_scale or v_scale shifts outputs by O(1)).
INT8_VS_TRUTH_TOL = 4e-2


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


SLIM_SHAPES = [  # seq_len, q_start, heads, kv_heads, head_dim, block_rows
    (37, 0, 9, 3, 64, 16),     # several blocks, last one partial, GQA 3
    (1, 20, 4, 4, 16, 16),     # single decode-like row over a prefix, MHA
    (300, 100, 9, 3, 64, 64),  # chunked prefill: cached prefix + new rows
    (130, 0, 8, 1, 32, 128),   # MQA, one full block + 2 rows
    (5, 3, 6, 2, 8, 128),      # block_rows > L
]


SLIM_IMPLS = [("torch", torch.float32), ("torch", torch.bfloat16), ("native", torch.bfloat16), ("native", torch.float32)]


@pytest.mark.parametrize("impl,dtype", SLIM_IMPLS)
@pytest.mark.parametrize("seq_len,q_start,heads,kv_heads,head_dim,block_rows", SLIM_SHAPES)
def test_slim_attention_matches_reference(impl, dtype, seq_len, q_start, heads, kv_heads, head_dim, block_rows):
    total = q_start + seq_len
    # q as the model passes it: rows of the fused qkv output (strided), each row's heads dense
    q = rand(seq_len, heads + 2 * kv_heads, head_dim, dtype=dtype, seed=1)[:, :heads]
    k = rand(total, kv_heads, head_dim, dtype=dtype, seed=2)
    v = rand(total, kv_heads, head_dim, dtype=dtype, seed=3)
    scale = head_dim ** -0.5
    fn = slim_attention if impl == "torch" else native_slim
    out = fn(q, k, v, q_start, scale, block_rows=block_rows)
    ref = reference_attention(q, k, v, q_start, scale)
    assert out.shape == (seq_len, heads, head_dim) and out.dtype == dtype
    assert (out.float() - ref.float()).abs().max() < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_slim_attention_writes_the_same_bits_into_out(dtype):
    """prefill's rows go straight into o_proj's input buffer (slim_attention.out): the bits of the result it would
    return, only those rows written, and an out of another shape, dtype or layout refused, naming what it must be."""
    q = rand(37, 9 + 6, 64, dtype=dtype, seed=1)[:, :9]
    k, v = rand(57, 3, 64, dtype=dtype, seed=2), rand(57, 3, 64, dtype=dtype, seed=3)
    whole = native_slim(q, k, v, 20, 0.125, block_rows=16)
    buf = torch.full((40, 9, 64), 7.0, dtype=dtype)
    got = torch.ops.cpuserve.slim_attention.out(q, k, v, 20, 0.125, 16, out=buf[2:39])
    assert got.data_ptr() == buf[2].data_ptr() and torch.equal(buf[2:39], whole)
    assert (buf[:2] == 7).all() and (buf[39:] == 7).all()
    for bad, why in [(torch.empty(36, 9, 64, dtype=dtype), "of q's sizes"),
                     (torch.empty(37, 9, 64, dtype=torch.float16), "contiguous"),
                     (torch.empty(9, 37, 64, dtype=dtype).transpose(0, 1), "not contiguous")]:
        with pytest.raises(RuntimeError, match=why):
            torch.ops.cpuserve.slim_attention.out(q, k, v, 20, 0.125, 16, out=bad)


@pytest.mark.parametrize("fn,dtype", [(slim_attention, torch.float32), (native_slim, torch.bfloat16),
                                      (native_slim, torch.float32)])
def test_slim_attention_is_causal(fn, dtype):
    q, k, v = (rand(8, 2, 16, seed=s, dtype=dtype) for s in (1, 2, 3))
    base = fn(q, k, v, 0, 0.25, block_rows=4)
    k2, v2 = k.clone(), v.clone()
    k2[5:] += 10
    v2[5:] -= 10
    changed = fn(q, k2, v2, 0, 0.25, block_rows=4)
    assert torch.equal(base[:5], changed[:5])
    assert not torch.allclose(base[5:], changed[5:])


def test_quantize_kv_round_trip_within_half_step():
    x = rand(50, 3, 64, seed=4) * torch.linspace(0.01, 10, 50)[:, None, None]
    x[7, 1] = 0  # an all-zero vector must not produce NaN
    q, s = quantize_kv(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (50, 3)
    err = (q.float() * s[..., None] - x).abs()
    assert (err <= 0.5 * s[..., None] * (1 + 1e-5)).all()
    assert torch.equal(q[7, 1], torch.zeros(64, dtype=torch.int8))
    assert q.abs().amax(-1)[s > 1e-20].eq(127).all()  # absmax maps to 127


def make_cache(dtype, num_blocks, block_size, kv_heads, head_dim):
    """K and V views of one pool [num_blocks, B, 2 Hkv, D], laid out as LayerKV does, full of garbage (NaN for
    floats, NaN/inf scales), as torch.empty may leave it."""
    shape = (num_blocks, block_size, 2 * kv_heads, head_dim)
    if dtype == torch.int8:
        pool = torch.randint(-128, 128, shape, dtype=torch.int8)
        scale = torch.cat([torch.full(shape[:2] + (kv_heads,), float("nan")),
                           torch.full(shape[:2] + (kv_heads,), float("inf"))], -1)
        return pool[:, :, :kv_heads], scale[..., :kv_heads], pool[:, :, kv_heads:], scale[..., kv_heads:]
    pool = torch.full(shape, float("nan"), dtype=dtype)
    return pool[:, :, :kv_heads], None, pool[:, :, kv_heads:], None


def native_decode(q, cache, tables, lens, scale, chunk_tokens=None):
    """The C++ kernel over the pool behind make_cache's views (chunk_tokens: it reads token by token)."""
    assert native.available(), "the fused kernels must build here (gcc and ninja are installed by the project)"
    pool = cache[0]._base
    pool_scale = None if cache[1] is None else cache[1]._base
    return torch.ops.cpuserve.decode_attention(q, pool, pool_scale, tables, lens, scale)


def fill_sequences(cache, lens, block_size, max_blocks, kv_heads, head_dim, seed=0):
    """Write random K/V for each sequence into shuffled, non-contiguous blocks. Returns tables and truths."""
    k_cache, k_scale, v_cache, v_scale = cache
    perm = torch.randperm(k_cache.shape[0], generator=torch.Generator().manual_seed(seed))
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)  # padding = block 0 (may be in use)
    truths, used = [], 0
    for s, length in enumerate(lens):
        num = -(-length // block_size)
        ids = perm[used:used + num]
        used += num
        tables[s, :num] = ids.to(torch.int32)
        k, v = rand(length, kv_heads, head_dim, seed=10 + s), rand(length, kv_heads, head_dim, seed=50 + s)
        slots = ids.repeat_interleave(block_size)[:length] * block_size + torch.arange(length) % block_size
        write_kv(k_cache, k_scale, v_cache, v_scale, k, v, slots)
        truths.append((k, v))
    return tables, truths


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32])
def test_write_then_gather_recovers_values(dtype):
    cache = make_cache(dtype, 12, 4, 2, 8)
    tables, truths = fill_sequences(cache, [9, 4, 1], 4, 3, 2, 8)
    for s, (k, v) in enumerate(truths):
        for x, c, sc in ((k, cache[0], cache[1]), (v, cache[2], cache[3])):
            got = gather_kv(c, sc, tables[s], x.shape[0], torch.float32)
            assert got.shape == x.shape
            if dtype == torch.float32:
                assert torch.equal(got, x)
            else:
                # int8: half a step of absmax/127; bf16: half an ulp, and an ulp is <= 2^-7 |x|
                step = x.abs().amax(-1, keepdim=True) / 127 if dtype == torch.int8 else x.abs() * 2 ** -7
                assert ((got - x).abs() <= 0.5 * step * (1 + 1e-5) + 1e-7).all()


@pytest.mark.parametrize("cache_dtype,q_dtype", [
    (torch.int8, torch.bfloat16), (torch.int8, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
])
@pytest.mark.parametrize("impl,chunk_tokens", [
    (paged_decode_attention, 16), (paged_decode_attention, 200), (paged_decode_attention, 4096),  # 1, 2, all blocks
    (native_decode, None),
])
def test_paged_decode_matches_reference(cache_dtype, q_dtype, impl, chunk_tokens):
    block_size, kv_heads, heads, head_dim = 16, 3, 9, 64
    lens = [5, 33, 100, 1, 64, 17]  # partial, exact and single-token blocks in one batch
    cache = make_cache(cache_dtype, 48, block_size, kv_heads, head_dim)
    tables, truths = fill_sequences(cache, lens, block_size, 8, kv_heads, head_dim)
    # q as the model passes it: a slice of the fused qkv rows (rows strided, each head's D contiguous)
    q = rand(len(lens), heads + 2 * kv_heads, head_dim, dtype=q_dtype, seed=99)[:, :heads]
    scale = head_dim ** -0.5
    lens_t = torch.tensor(lens, dtype=torch.int32)
    if impl is paged_decode_attention:
        out = paged_decode_attention(q, *cache, tables, lens_t, scale, chunk_tokens=chunk_tokens)
    else:
        out = native_decode(q, cache, tables, lens_t, scale)
    assert out.shape == q.shape and out.dtype == q_dtype and torch.isfinite(out.float()).all()
    for s, length in enumerate(lens):
        k = gather_kv(cache[0], cache[1], tables[s], length, torch.float32)
        v = gather_kv(cache[2], cache[3], tables[s], length, torch.float32)
        ref = reference_attention(q[s:s + 1].float(), k, v, length - 1, scale)
        tol = TOL[q_dtype] if q_dtype == torch.bfloat16 else 1e-5
        assert (out[s].float() - ref[0]).abs().max() < tol, f"sequence {s}"
        if cache_dtype == torch.int8:
            truth = reference_attention(q[s:s + 1].float(), *truths[s], length - 1, scale)
            assert (out[s].float() - truth[0]).abs().max() < INT8_VS_TRUTH_TOL, f"sequence {s} vs fp32 truth"


@pytest.mark.parametrize("head_dim", [24, 96, 128])  # the portable loops (24) and 16-wide blocks of 6 and 8
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (7, 1)])  # 4 query rows per kv head, and 7 (two row groups)
def test_native_decode_other_head_shapes(head_dim, heads, kv_heads):
    block_size, lens = 16, [1, 15, 16, 17, 40]  # a token, a block but one, one, one over, a tail of 8
    cache = make_cache(torch.int8, 24, block_size, kv_heads, head_dim)
    tables, _ = fill_sequences(cache, lens, block_size, 3, kv_heads, head_dim)
    q = rand(len(lens), heads, head_dim, seed=7)
    out = native_decode(q, cache, tables, torch.tensor(lens, dtype=torch.int32), head_dim ** -0.5)
    for s, length in enumerate(lens):
        k = gather_kv(cache[0], cache[1], tables[s], length, torch.float32)
        v = gather_kv(cache[2], cache[3], tables[s], length, torch.float32)
        ref = reference_attention(q[s:s + 1], k, v, length - 1, head_dim ** -0.5)
        assert (out[s] - ref[0]).abs().max() < 1e-5, f"sequence {s} (length {length})"


@pytest.mark.parametrize("products", ["brgemm", "avx512_bf16"])
def test_each_product_kernel_matches_reference_with_rows_independent_of_chunking(products):
    """The C++ SlimAttention's two product kernels: the engine runs the CPU's best (brgemm where torch offers it,
    i.e. AMX); the other is switched on here too where the CPU has it, so an AMX machine checks both."""
    assert native.available(), "the fused kernels must build here (gcc and ninja are installed by the project)"
    switch = torch.ops.cpuserve.slim_attention_products
    before = switch("")
    try:
        switch(products)
    except RuntimeError as e:  # kernel_paths.py lists it as not run here
        pytest.skip(str(e))
    try:
        assert torch.ops.cpuserve.slim_attention_kernel() == products
        for seq_len, q_start, heads, kv_heads, head_dim, block_rows in SLIM_SHAPES:
            total = q_start + seq_len
            q = rand(seq_len, heads, head_dim, dtype=torch.bfloat16, seed=1)
            k, v = (rand(total, kv_heads, head_dim, dtype=torch.bfloat16, seed=s) for s in (2, 3))
            out = torch.ops.cpuserve.slim_attention(q, k, v, q_start, head_dim ** -0.5, block_rows)
            ref = reference_attention(q, k, v, q_start, head_dim ** -0.5)
            assert (out.float() - ref.float()).abs().max() < TOL[torch.bfloat16], (seq_len, q_start, heads)
        q, k, v = (rand(700, heads, 64, dtype=torch.bfloat16, seed=s) for s, heads in ((1, 9), (2, 3), (3, 3)))
        whole = torch.ops.cpuserve.slim_attention(q, k, v, 0, 0.125, 32)
        for start in (100, 517, 699):
            part = torch.ops.cpuserve.slim_attention(q[start:].contiguous(), k, v, start, 0.125, 32)
            assert torch.equal(part, whole[start:]), f"chunk from {start}"
    finally:
        switch(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_slim_rows_do_not_depend_on_chunking(dtype):
    """A prompt prefilled whole, in chunks, or after a prefix-cache hit must give bit-identical rows: replica
    ranks and batch-invariance tests compare engines whose prompts were split differently, and a prompt's logprobs
    must not depend on whether its prefix came from the cache (test_prefix_cache.py). slim_attention's fp32 rows
    did (torch's matmuls round a row by its block's size): fp32 prefill has a kernel of its own for this."""
    q, k, v = (rand(700, heads, 64, dtype=dtype, seed=s) for s, heads in ((1, 9), (2, 3), (3, 3)))
    whole = native_slim(q, k, v, 0, 0.125, block_rows=32)
    for start in (100, 517, 699):  # chunks crossing key blocks (256 keys), starting inside one, and at the end
        part = native_slim(q[start:].contiguous(), k, v, start, 0.125, block_rows=32)
        assert torch.equal(part, whole[start:]), f"chunk from {start}"
    assert torch.equal(native_slim(q, k, v, 0, 0.125, block_rows=16), whole)  # nor on the row block size
