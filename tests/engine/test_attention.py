"""SlimAttention and paged decode attention against the plain reference; KV cache quantization and I/O."""
import pytest
import torch

from cpuserve.engine.layers.attention import (gather_kv, paged_decode_attention, quantize_kv,
                                              reference_attention, slim_attention, write_kv)

# fp32: same math, different summation order. bf16: the result is rounded to bf16 (2^-9 relative of values
# that are convex combinations of N(0,1) entries, so |out| < ~4).
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# int8 KV vs the unquantized truth: half a step (absmax/254) per element; on N(0,1) data the attention output
# moves by ~1e-2 at most (measured ~1.2e-2 worst over these shapes), so 4e-2 is a loose but meaningful bound
# (a missing k_scale or v_scale shifts outputs by O(1)).
INT8_VS_TRUTH_TOL = 4e-2


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_len,q_start,heads,kv_heads,head_dim,block_rows", [
    (37, 0, 9, 3, 64, 16),     # several blocks, last one partial, GQA 3
    (1, 20, 4, 4, 16, 16),     # single decode-like row over a prefix, MHA
    (300, 100, 9, 3, 64, 64),  # chunked prefill: cached prefix + new rows
    (130, 0, 8, 1, 32, 128),   # MQA, one full block + 2 rows
    (5, 3, 6, 2, 8, 128),      # block_rows > L
])
def test_slim_attention_matches_reference(dtype, seq_len, q_start, heads, kv_heads, head_dim, block_rows):
    total = q_start + seq_len
    q = rand(seq_len, heads, head_dim, dtype=dtype, seed=1)
    k = rand(total, kv_heads, head_dim, dtype=dtype, seed=2)
    v = rand(total, kv_heads, head_dim, dtype=dtype, seed=3)
    scale = head_dim ** -0.5
    out = slim_attention(q, k, v, q_start, scale, block_rows=block_rows)
    ref = reference_attention(q, k, v, q_start, scale)
    assert out.shape == (seq_len, heads, head_dim) and out.dtype == dtype
    assert (out.float() - ref.float()).abs().max() < TOL[dtype]


def test_slim_attention_is_causal():
    q, k, v = rand(8, 2, 16, seed=1), rand(8, 2, 16, seed=2), rand(8, 2, 16, seed=3)
    base = slim_attention(q, k, v, 0, 0.25, block_rows=4)
    k2, v2 = k.clone(), v.clone()
    k2[5:] += 10
    v2[5:] -= 10
    changed = slim_attention(q, k2, v2, 0, 0.25, block_rows=4)
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
    """A pool full of garbage (NaN for floats, inf/NaN scales), as torch.empty may leave it."""
    if dtype == torch.int8:
        k = torch.randint(-128, 128, (num_blocks, block_size, kv_heads, head_dim), dtype=torch.int8)
        ks = torch.full((num_blocks, block_size, kv_heads), float("nan"))
        vs = torch.full((num_blocks, block_size, kv_heads), float("inf"))
        return k, ks, k.clone(), vs
    k = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    return k, None, k.clone(), None


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
@pytest.mark.parametrize("chunk_tokens", [16, 200, 4096])  # 1 block, 2 blocks (uneven), all
def test_paged_decode_matches_reference(cache_dtype, q_dtype, chunk_tokens):
    block_size, kv_heads, heads, head_dim = 16, 3, 9, 64
    lens = [5, 33, 100, 1, 64, 17]  # partial, exact and single-token blocks in one batch
    cache = make_cache(cache_dtype, 48, block_size, kv_heads, head_dim)
    tables, truths = fill_sequences(cache, lens, block_size, 8, kv_heads, head_dim)
    q = rand(len(lens), heads, head_dim, dtype=q_dtype, seed=99)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, *cache, tables, torch.tensor(lens, dtype=torch.int32), scale,
                                 chunk_tokens=chunk_tokens)
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
