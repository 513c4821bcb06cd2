"""SlimAttention's Q K^T as int8 dot products (engine/csrc/int8_scores.h): K as the int8 pool stores it, each query
row quantized in groups of 32 dims. The C++ kernel against the plain-torch reference, both against attention
in fp32 with K unquantized, row independence, and which layers take this path. The kernel's avx512_bf16 products
(the only ones that take an int8 K) are switched on for these tests on a CPU with AMX too, where the engine runs
oneDNN's brgemm."""
import pytest
import torch

from cpuserve.engine.layers import native, ops
from cpuserve.engine.layers.attention import Q_GROUP, quantize_kv, reference_attention, slim_attention
from cpuserve.engine.layers.kv_quant import LayerKV, write_kv_fused
from cpuserve.engine.layers.linear.act_int8 import quantize_rows

# kernel vs reference: the same integers, then fp32 scores rounded differently and a bf16 result (2^-9 relative of
# values below ~4), as test_attention's bf16 bound
TOL = 2e-2
# against fp32 attention on unquantized K, N(0,1) data: the int8 K (half a step of its absmax / 127 a key) and q
# (the same, a group of 32 dims) moved outputs by up to 0.02 over the shapes below, the bf16 products on the same
# int8 K by up to 0.02 (test_attention's bound for an int8 cache is 4e-2); a lost scale moves them by O(1)
TRUTH_TOL = 4e-2


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def int8_kernel():
    """The C++ SlimAttention with its avx512_bf16 products, which take an int8 K. The engine picks them where the
    CPU has no AMX; on a CPU with AMX (where it picks oneDNN's brgemm) they are switched on for the test."""
    assert native.available(), "the fused kernels must build here (gcc and ninja are installed by the project)"
    products = torch.ops.cpuserve.slim_attention_products
    before = products("")
    try:
        products("avx512_bf16")
    except RuntimeError as e:  # kernel_paths.py reports the path as not run
        pytest.skip(f"no avx512_bf16 products here: {e}")
    if not torch.ops.cpuserve.slim_attention_int8_keys():
        products(before)
        pytest.skip("the C++ SlimAttention takes an int8 K only with AVX-512 VNNI, which this CPU lacks")
    yield
    products(before)


def case(seq_len, q_start, heads, kv_heads, head_dim, spread=False):
    total = q_start + seq_len
    q = rand(seq_len, heads + 2 * kv_heads, head_dim, dtype=torch.bfloat16, seed=1)[:, :heads]  # strided, as qkv's
    k = rand(total, kv_heads, head_dim, seed=2)
    if spread:  # keys of very different sizes: a lost or misplaced scale would show
        k *= torch.logspace(-1, 0.5, total)[:, None, None]
    v = rand(total, kv_heads, head_dim, dtype=torch.bfloat16, seed=3)
    codes, scale = quantize_kv(k)
    return q, k, codes, scale, v


SHAPES = [  # seq_len, q_start, heads, kv_heads, head_dim, block_rows, window
    (37, 0, 9, 3, 64, 16, 0),     # several row blocks, the last partial; GQA 3 (SmolLM2)
    (300, 100, 9, 3, 64, 64, 0),  # a chunk after a cached prefix, across a 256-key block
    (130, 0, 8, 1, 32, 128, 0),   # MQA, one group of dims
    (70, 0, 4, 2, 128, 32, 0),    # four groups of dims
    (1, 20, 4, 4, 64, 16, 0),     # one row over a prefix
    (300, 0, 4, 2, 64, 32, 40),   # a sliding window (Gemma 3's local layers)
]


@pytest.mark.parametrize("seq_len,q_start,heads,kv_heads,head_dim,block_rows,window", SHAPES)
def test_int8_scores_kernel_matches_reference(int8_kernel, seq_len, q_start, heads, kv_heads, head_dim, block_rows,
                                             window):
    q, _, codes, scale, v = case(seq_len, q_start, heads, kv_heads, head_dim, spread=True)
    sm = head_dim ** -0.5
    out = torch.ops.cpuserve.slim_attention(q, codes, v, q_start, sm, block_rows, window, scale)
    ref = slim_attention(q, codes, v, q_start, sm, block_rows=block_rows, window=window, k_scale=scale)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert (out.float() - ref.float()).abs().max() < TOL


@pytest.mark.parametrize("impl", ["torch", "native"])
@pytest.mark.parametrize("seq_len,q_start,heads,kv_heads,head_dim,block_rows,window", SHAPES)
def test_int8_scores_match_fp32_attention(request, impl, seq_len, q_start, heads, kv_heads, head_dim, block_rows,
                                          window):
    q, k, codes, scale, v = case(seq_len, q_start, heads, kv_heads, head_dim)
    sm = head_dim ** -0.5
    if impl == "native":
        request.getfixturevalue("int8_kernel")
        out = torch.ops.cpuserve.slim_attention(q, codes, v, q_start, sm, block_rows, window, scale)
    else:
        out = slim_attention(q, codes, v, q_start, sm, block_rows=block_rows, window=window, k_scale=scale)
    truth = reference_attention(q.float(), k, v.float(), q_start, sm, window=window)
    assert (out.float() - truth).abs().max() < TRUTH_TOL


def test_int8_scores_differ_from_bf16_products(int8_kernel):
    """The int8 path is taken, not a bf16 product under another name: its rows differ from the bf16 kernel's on the
    same dequantized keys, by about the quantization of q."""
    q, _, codes, scale, v = case(64, 0, 9, 3, 64)
    dequantized = (codes.float() * scale[..., None]).bfloat16()
    int8 = torch.ops.cpuserve.slim_attention(q, codes, v, 0, 0.125, 32, 0, scale)
    bf16 = torch.ops.cpuserve.slim_attention(q, dequantized, v, 0, 0.125, 32, 0)
    diff = (int8.float() - bf16.float()).abs().max()
    assert 0 < diff < TRUTH_TOL


def test_int8_scores_rows_do_not_depend_on_chunking(int8_kernel):
    """A row's result depends on that row and the keys alone: whole, in chunks after a prefix, with other row blocks
    or a sliding window's later start, bit for bit."""
    q, _, codes, scale, v = case(700, 0, 9, 3, 64)
    whole = torch.ops.cpuserve.slim_attention(q, codes, v, 0, 0.125, 32, 0, scale)
    for start in (100, 517, 699):
        part = torch.ops.cpuserve.slim_attention(q[start:].contiguous(), codes, v, start, 0.125, 32, 0, scale)
        assert torch.equal(part, whole[start:]), f"chunk from {start}"
    assert torch.equal(torch.ops.cpuserve.slim_attention(q, codes, v, 0, 0.125, 16, 0, scale), whole)
    windowed = torch.ops.cpuserve.slim_attention(q, codes, v, 0, 0.125, 32, 300, scale)
    first = (600 - 300 + 1) // 256 * 256  # as the model calls it: from the 256-key block the chunk's window reaches
    part = torch.ops.cpuserve.slim_attention(q[600:].contiguous(), codes[first:].contiguous(), v[first:].contiguous(),
                                             600 - first, 0.125, 32, 300, scale[first:].contiguous())
    assert torch.equal(part, windowed[600:])


@pytest.mark.parametrize("change,message", [
    ("no_scale", "k_scale goes with an int8 k"),
    ("scale_with_bf16", "k_scale goes with an int8 k"),
    ("head_dim_16", "head_dim a multiple of 32"),
    ("scale_shape", "k_scale fp32 [T, Hkv]"),
])
def test_int8_scores_refusals(int8_kernel, change, message):
    head_dim = 16 if change == "head_dim_16" else 64
    q, _, codes, scale, v = case(8, 0, 4, 2, head_dim)
    k, k_scale = codes, scale
    if change == "no_scale":
        k_scale = None
    elif change == "scale_with_bf16":
        k = v.clone()
    elif change == "scale_shape":
        k_scale = scale[:, :1].contiguous()
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        torch.ops.cpuserve.slim_attention(q, k, v, 0, 0.125, 32, 0, k_scale)


def test_an_int8_k_is_refused_by_the_brgemm_products():
    products = torch.ops.cpuserve.slim_attention_products
    before = products("")
    try:
        products("brgemm")
    except RuntimeError:
        pytest.skip("torch offers no bf16 brgemm on this CPU (it needs AMX)")
    try:
        q, _, codes, scale, v = case(8, 0, 4, 2, 64)
        with pytest.raises(RuntimeError, match="an int8 k needs the avx512_bf16 kernel"):
            torch.ops.cpuserve.slim_attention(q, codes, v, 0, 0.125, 32, 0, scale)
    finally:
        products(before)


def pool_with(tokens: int, kv_heads: int, head_dim: int) -> tuple[LayerKV, torch.Tensor]:
    block_size, blocks = 16, 8
    pool = LayerKV(torch.zeros(blocks, block_size, 2 * kv_heads, head_dim, dtype=torch.int8),
                   torch.zeros(blocks, block_size, 2 * kv_heads))
    table = torch.tensor([5, 2, 7, 0], dtype=torch.int32)
    slots = (table.long()[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:tokens]
    write_kv_fused(pool.kv, pool.scale, rand(tokens, 2 * kv_heads, head_dim, seed=4), slots)
    return pool, table


@pytest.mark.parametrize("int8_keys", [True, False])
def test_prefill_context_gives_the_pools_codes_only_to_int8_layers(int8_keys):
    """What the model's prefill reads: the pool's own K codes and scales where the layer's activations are int8 and
    the kernel takes them, else K dequantized like V (activations=bf16 keeps bf16 products)."""
    pool, table = pool_with(40, 2, 64)
    k, k_scale, v = ops.prefill_context(pool, table, 40, torch.bfloat16, int8_keys)
    k_ref, v_ref = ops.gather_kv(pool, table, 40, torch.bfloat16)
    assert torch.equal(v, v_ref)
    if int8_keys and native.slim_attention_int8_keys():
        flat, scales = pool.k.reshape(-1, 2, 64), pool.k_scale.reshape(-1, 2)
        rows = (table.long()[:, None] * 16 + torch.arange(16)).reshape(-1)[:40]
        assert k.dtype == torch.int8 and torch.equal(k, flat[rows]) and torch.equal(k_scale, scales[rows])
    else:
        assert k_scale is None and torch.equal(k, k_ref)


def test_the_builder_gives_int8_keys_to_int8_activations_only(llm_int4):
    """activations decides for attention too: "bf16" (the exact path the references compare against) never runs
    Q K^T in int8."""
    from cpuserve.engine.llm import LLM

    assert all(layer.attention.int8_keys for layer in llm_int4.engine.runner.model.layers)
    exact = LLM(weights="int4", activations="bf16", kv_cache_gb=0.05, show_progress=False)
    assert not any(layer.attention.int8_keys for layer in exact.engine.runner.model.layers)


def test_each_group_of_32_dims_has_its_own_scale(int8_kernel):
    """q with dims 0-31 a hundred times dims 32-63: one scale a head would round the small half to zero and the
    scores would leave the reference's by far more than TOL."""
    q, _, codes, scale, v = case(40, 0, 4, 2, 64)
    q = (q.float() * torch.cat([torch.full((Q_GROUP,), 100.0), torch.ones(64 - Q_GROUP)])).bfloat16()
    k = (codes.float() * torch.cat([torch.full((Q_GROUP,), 0.01), torch.ones(64 - Q_GROUP)])).round().to(torch.int8)
    out = torch.ops.cpuserve.slim_attention(q, k, v, 0, 0.125, 32, 0, scale)
    ref = slim_attention(q, k, v, 0, 0.125, block_rows=32, k_scale=scale)
    codes64, scale64 = quantize_rows(q.reshape(-1, 64), 64)  # one scale a head, in plain torch
    q64 = (codes64 * scale64).view(q.shape)
    head_scaled = reference_attention(q64, k.float() * scale[..., None], v.float(), 0, 0.125)
    assert (out.float() - ref.float()).abs().max() < TOL
    assert (head_scaled.float() - ref.float()).abs().max() > 10 * TOL
