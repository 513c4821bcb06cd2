"""Sliding-window attention (Gemma 3's local layers): prefill (SlimAttention, torch and C++) and paged decode
(reference and C++) against plain causal attention over each query's own window of keys."""
import pytest
import torch
from test_attention import SLIM_IMPLS, TOL, fill_sequences, make_cache, native_decode, native_slim, rand

from cpuserve.engine.layers.attention import gather_kv, paged_decode_attention, reference_attention, slim_attention


def windowed_truth(q, k, v, q_start, scale, window):
    """Row by row: query i (position p = q_start + i) over keys max(0, p - window + 1) .. p, no window mask."""
    rows = []
    for i in range(q.shape[0]):
        p = q_start + i
        lo = max(0, p - window + 1)
        rows.append(reference_attention(q[i:i + 1].float(), k[lo:p + 1].float(), v[lo:p + 1].float(), p - lo, scale))
    return torch.cat(rows)


@pytest.mark.parametrize("impl,dtype", SLIM_IMPLS)
@pytest.mark.parametrize("seq_len,q_start,heads,kv_heads,head_dim,block_rows,window", [
    (37, 0, 9, 3, 64, 16, 8),      # window shorter than a row block
    (300, 100, 4, 2, 32, 64, 70),  # chunked prefill: the window reaches back into the cached prefix
    (600, 0, 4, 1, 32, 32, 300),   # window across the kernel's 256-key blocks
    (20, 5, 4, 4, 16, 8, 1),       # a window of one key: each query sees only itself
    (40, 0, 4, 2, 16, 16, 64),     # window longer than the context: plain causal attention
])
def test_windowed_prefill_matches_truth(impl, dtype, seq_len, q_start, heads, kv_heads, head_dim, block_rows,
                                        window):
    total = q_start + seq_len
    q = rand(seq_len, heads + 2 * kv_heads, head_dim, dtype=dtype, seed=1)[:, :heads]
    k = rand(total, kv_heads, head_dim, dtype=dtype, seed=2)
    v = rand(total, kv_heads, head_dim, dtype=dtype, seed=3)
    scale = head_dim ** -0.5
    if impl == "torch":
        out = slim_attention(q, k, v, q_start, scale, block_rows=block_rows, window=window)
    else:
        native_slim(q[:1], k[:1 + q_start], v[:1 + q_start], q_start, scale, block_rows)  # skips if not used here
        out = torch.ops.cpuserve.slim_attention(q, k, v, q_start, scale, block_rows, window)
    truth = windowed_truth(q, k, v, q_start, scale, window)
    assert (out.float() - truth).abs().max() < TOL[dtype]
    assert (reference_attention(q, k, v, q_start, scale, window=window).float() - truth).abs().max() < TOL[dtype]
    if window < total:  # the window matters: without it the result differs
        assert (reference_attention(q, k, v, q_start, scale).float() - truth).abs().max() > 10 * TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_windowed_rows_do_not_depend_on_chunking(dtype):
    q, k, v = (rand(700, heads, 64, dtype=dtype, seed=s) for s, heads in ((1, 8), (2, 2), (3, 2)))
    native_slim(q[:1], k[:1], v[:1], 0, 0.125, 32)  # skips where the C++ SlimAttention is not used
    whole = torch.ops.cpuserve.slim_attention(q, k, v, 0, 0.125, 32, 300)
    for start in (100, 517, 699):
        # as the model calls it: the context from the first 256-key block the chunk's window reaches
        first = max(0, start - 300 + 1) // 256 * 256
        part = torch.ops.cpuserve.slim_attention(q[start:].contiguous(), k[first:].contiguous(),
                                                 v[first:].contiguous(), start - first, 0.125, 32, 300)
        assert torch.equal(part, whole[start:]), f"chunk from {start}"


@pytest.mark.parametrize("cache_dtype,q_dtype", [(torch.int8, torch.bfloat16), (torch.float32, torch.float32)])
@pytest.mark.parametrize("impl", ["reference", "native"])
def test_windowed_decode_matches_truth(cache_dtype, q_dtype, impl):
    block_size, kv_heads, heads, head_dim, window = 16, 2, 8, 64, 20
    lens = [5, 33, 100, 1, 64, 21, 20]  # shorter than, equal to, one past and far past the window
    cache = make_cache(cache_dtype, 48, block_size, kv_heads, head_dim)
    tables, _ = fill_sequences(cache, lens, block_size, 8, kv_heads, head_dim)
    q = rand(len(lens), heads + 2 * kv_heads, head_dim, dtype=q_dtype, seed=99)[:, :heads]
    scale = head_dim ** -0.5
    lens_t = torch.tensor(lens, dtype=torch.int32)
    if impl == "reference":
        out = paged_decode_attention(q, *cache, tables, lens_t, scale, chunk_tokens=200, window=window)
    else:
        native_decode(q, cache, tables, lens_t, scale)  # fails if the kernels do not build
        pool_scale = None if cache[1] is None else cache[1]._base
        out = torch.ops.cpuserve.decode_attention(q, cache[0]._base, pool_scale, tables, lens_t, scale, window)
    assert torch.isfinite(out.float()).all()
    for s, length in enumerate(lens):
        k = gather_kv(cache[0], cache[1], tables[s], length, torch.float32)
        v = gather_kv(cache[2], cache[3], tables[s], length, torch.float32)
        truth = windowed_truth(q[s:s + 1], k, v, length - 1, scale, window)
        tol = TOL[q_dtype] if q_dtype == torch.bfloat16 else 1e-5
        assert (out[s].float() - truth[0]).abs().max() < tol, f"sequence {s}"
