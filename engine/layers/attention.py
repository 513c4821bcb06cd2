"""Attention kernels: SlimAttention for prefill, the hybrid INT8 paged kernel for decode, and a plain reference.

In plain torch: the references of the C++ kernels, which ops.py chooses between. All functions are pure.
Grouped-query attention: n_heads H = g * n_kv_heads Hkv, query head h reads kv head h // g. Scores and softmax
run in fp32; results come back in q's dtype. window (Gemma 3's sliding-window layers; 0 = none): the query at
position p attends keys p - window + 1 .. p only, as transformers' sliding_window mask.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from cpuserve.engine.layers.kv_quant import gather_kv, quantize_kv, write_kv, write_kv_fused
from cpuserve.engine.layers.linear.act_int8 import quantize_rows

__all__ = ["quantize_kv", "write_kv", "write_kv_fused", "gather_kv", "decode_mask", "slim_attention",
           "paged_decode_attention", "reference_attention", "SLIM_BLOCK_ROWS", "DECODE_CHUNK_TOKENS"]

Q_GROUP = 32  # query dims per scale when Q K^T runs in int8 (int8_scores.h's kQGroup)
SLIM_BLOCK_ROWS = 64  # query rows per SlimAttention block (bench/attention.py: 32..128 within noise, 256 slower)
DECODE_CHUNK_TOKENS = 4096  # (sequence, token) pairs converted to fp32 per decode chunk (bench: best of 256..16384)


def reference_attention(q: Tensor, k: Tensor, v: Tensor, q_start: int, scale: float, window: int = 0) -> Tensor:
    """softmax(q k^T * scale + causal mask) v in fp32, GQA by repeat_interleave.

    Args:
        q: [L, H, D]; k, v: [T, Hkv, D] with T = q_start + L.
    Returns:
        [L, H, D] in q.dtype.
    """
    seq_len, num_heads, _ = q.shape
    g = num_heads // k.shape[1]
    kf = k.float().repeat_interleave(g, dim=1).transpose(0, 1)  # kf: [H, T, D]
    vf = v.float().repeat_interleave(g, dim=1).transpose(0, 1)  # vf: [H, T, D]
    qf = q.float().transpose(0, 1)  # qf: [H, L, D]
    scores = qf @ kf.transpose(1, 2) * scale  # scores: [H, L, T]
    pos_q = torch.arange(seq_len)[:, None] + q_start
    pos_k = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill((pos_k > pos_q) | _outside_window(pos_k, pos_q, window), float("-inf"))
    out = scores.softmax(-1) @ vf  # out: [H, L, D]
    return out.transpose(0, 1).to(q.dtype)


def _outside_window(pos_k: Tensor, pos_q: Tensor, window: int) -> Tensor | bool:
    """Keys that fell out of a sliding window (broadcasting positions); False when there is none."""
    return pos_k <= pos_q - window if window > 0 else False


def slim_attention(q: Tensor, k: Tensor, v: Tensor, q_start: int, scale: float,
                   block_rows: int = SLIM_BLOCK_ROWS, window: int = 0, k_scale: Tensor | None = None) -> Tensor:
    """Causal prefill attention split along query rows only (SlimAttention, xFasterTransformer).

    Each block of `block_rows` query rows computes its full score row against the keys it can see (keys past
    the block's last position are skipped, not masked), softmax, times V. No online-softmax rescaling: the
    extra memory is one fp32 block of scores, [H, block_rows, T].

        keys ->   0 ........ q_start ............ T
        block 0   [ prefix  | \\                ]   only the last block_rows columns need the causal mask
        block 1   [ prefix  | ###### \\         ]
        block 2   [ prefix  | ############ \\   ]

    Args:
        q: [L, H, D]; k, v: [T, Hkv, D], T = q_start + L (cached prefix + new tokens); query i sits at
            absolute position q_start + i and attends keys 0 .. q_start + i.
        scale: softmax scale, usually D ** -0.5.
        window: > 0 for a sliding-window layer; a block then starts at its first row's first key.
        k_scale: [T, Hkv] fp32 with an int8 k (the KV pool's codes, k ~= k * k_scale): Q K^T then runs in integers
            as the C++ kernel's (engine/csrc/int8_scores.h), each query row (token, head) quantized to int8 on
            its own, one scale per Q_GROUP dims (act_int8.quantize_rows): score = (dequantized q . k) * k_scale.
    Returns:
        [L, H, D] in q.dtype.
    """
    seq_len, num_heads, head_dim = q.shape
    total, num_kv_heads, _ = k.shape
    if total != q_start + seq_len:
        raise ValueError(f"k/v length {total} must equal q_start + L = {q_start + seq_len}")
    g = num_heads // num_kv_heads
    # Rows of one kv head's group sit together, so a row block is a view: row r * g + j = query r, head j.
    if k_scale is None:
        qh = (q.float() * scale).view(seq_len, num_kv_heads, g, head_dim).transpose(0, 1).contiguous()  # [Hkv, L, g, D]
    else:  # q as its int8 codes times their group scales, K as its codes; the key scales multiply the scores
        codes, q_scale = quantize_rows(q.reshape(seq_len * num_heads, head_dim), Q_GROUP)
        qf = (codes.view(-1, head_dim // Q_GROUP, Q_GROUP) * q_scale[..., None]) * scale
        qh = qf.view(seq_len, num_kv_heads, g, head_dim).transpose(0, 1).contiguous()  # qh: [Hkv, L, g, D]
        key_scale = k_scale.float().t()  # key_scale: [Hkv, T]
    kh = k.float().transpose(0, 1).contiguous()  # kh: [Hkv, T, D]
    vh = v.float().transpose(0, 1).contiguous()  # vh: [Hkv, T, D]
    out = torch.empty(seq_len, num_kv_heads, g, head_dim, dtype=q.dtype)
    rows_max = min(block_rows, seq_len)
    causal = _causal_mask(rows_max, g)
    # One scores buffer and one output buffer for all blocks: fresh multi-MB tensors per block would cost
    # page faults on every call.
    score_buf = torch.empty(num_kv_heads * rows_max * g * total)
    out_buf = torch.empty(num_kv_heads * rows_max * g * head_dim)
    for start in range(0, seq_len, block_rows):
        rows = min(block_rows, seq_len - start)
        end_key = q_start + start + rows  # keys beyond the block's last query are never seen
        first_key = max(0, q_start + start + 1 - window) if window > 0 else 0  # keys before it no row sees
        n = end_key - first_key
        qb = qh[:, start:start + rows].reshape(num_kv_heads, rows * g, head_dim)  # qb: [Hkv, rows*g, D]
        scores = score_buf[: num_kv_heads * rows * g * n].view(num_kv_heads, rows * g, n)
        torch.bmm(qb, kh[:, first_key:end_key].transpose(1, 2), out=scores)  # scores: [Hkv, rows*g, n]
        if k_scale is not None:
            scores *= key_scale[:, None, first_key:end_key]
        if window > 0:
            scores += _window_mask(q_start + start, rows, first_key, n, window, g)
        else:
            scores[:, :, n - rows:] += causal[: rows * g, :rows]
        torch.ops.aten._softmax.out(scores, -1, False, out=scores)  # in place: row by row, input read first
        ob = out_buf[: num_kv_heads * rows * g * head_dim].view(num_kv_heads, rows * g, head_dim)
        torch.bmm(scores, vh[:, first_key:end_key], out=ob)  # ob: [Hkv, rows*g, D]
        out[start:start + rows] = ob.view(num_kv_heads, rows, g, head_dim).transpose(0, 1)
    return out.view(seq_len, num_heads, head_dim)


def _window_mask(q_pos: int, rows: int, first_key: int, n: int, window: int, g: int) -> Tensor:
    """-inf where query row r * g + j (position q_pos + r) may not see key first_key + c: [rows * g, n]."""
    pos_q = torch.arange(rows)[:, None] + q_pos
    pos_k = torch.arange(n)[None, :] + first_key
    bad = (pos_k > pos_q) | _outside_window(pos_k, pos_q, window)
    return torch.zeros(rows, n).masked_fill_(bad, float("-inf")).repeat_interleave(g, dim=0)


def decode_mask(context_lens: Tensor, block_size: int, window: int = 0) -> Tensor:
    """invalid[s, 0, 0, t]: position t is past sequence s's context (padding blocks, unwritten slots), or out of
    a sliding window of `window` tokens ending at the new token.

    Depends only on the step's batch, so the model computes it once per step (per window), not once per layer.
    """
    lens = context_lens.to(torch.int64)
    total = -(-int(lens.max()) // block_size) * block_size
    pos = torch.arange(total)[None, :]
    invalid = (pos >= lens[:, None]) | _outside_window(pos, lens[:, None] - 1, window)
    return invalid.view(len(lens), 1, 1, total)


@functools.lru_cache(maxsize=64)
def _causal_mask(rows: int, g: int) -> Tensor:
    """causal[r * g + j, c] masks key c of a row block's last `rows` columns for query row r (read only).

    Every layer of every prefill step needs the same few masks: build each once.
    """
    return torch.full((rows, rows), float("-inf")).triu_(1).repeat_interleave(g, dim=0)


def paged_decode_attention(q: Tensor, k_cache: Tensor, k_scale: Tensor | None, v_cache: Tensor,
                           v_scale: Tensor | None, block_tables: Tensor, context_lens: Tensor, scale: float,
                           chunk_tokens: int = DECODE_CHUNK_TOKENS, invalid: Tensor | None = None,
                           window: int = 0) -> Tensor:
    """One new token per sequence against its paged context, batched over sequences.

    Two passes over the context in chunks of whole blocks; each chunk is gathered from the pool and converted
    to fp32 on its own, so the extra memory is one chunk of K or V for the batch plus the fp32 scores
    [S, H, max_context] (never an fp32 copy of the cache). For int8 caches this is the hybrid INT8 kernel:
    scores = (q . k_int8) * k_scale, out = sum_t (p_t * v_scale_t) * v_int8_t.

    Args:
        q: [S, H, D], the new tokens' queries (their keys/values already written to the cache).
        k_cache, v_cache: [num_blocks, B, Hkv, D]; k_scale, v_scale: [num_blocks, B, Hkv] fp32 or None.
        block_tables: [S, max_blocks] int32, padded with any valid block id.
        context_lens: [S] int32, >= 1, including the new token.
        chunk_tokens: (sequence, context token) pairs per chunk, summed over the batch; each chunk covers the
            same whole blocks of every sequence (at least one block).
        invalid: decode_mask(context_lens, B, window), when the caller already has it.
        window: > 0 for a sliding-window layer (the last `window` tokens of each context).
    Returns:
        [S, H, D] in q.dtype.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    g = num_heads // num_kv_heads
    if invalid is None:
        invalid = decode_mask(context_lens, block_size, window)
    num_blocks = invalid.shape[-1] // block_size
    chunk_blocks = max(1, chunk_tokens // (num_seqs * block_size))
    qg = (q.float() * scale).reshape(num_seqs, num_kv_heads, g, head_dim)  # qg: [S, Hkv, g, D]
    parts = []
    for c0 in range(0, num_blocks, chunk_blocks):
        c1 = min(num_blocks, c0 + chunk_blocks)
        kc, ks = _load_chunk(k_cache, k_scale, block_tables, c0, c1)  # kc: [S, Hkv, n, D]
        sc = torch.matmul(qg, kc.transpose(-1, -2))  # sc: [S, Hkv, g, n]
        parts.append(sc.mul_(ks.unsqueeze(2)) if ks is not None else sc)
    scores = parts[0] if len(parts) == 1 else torch.cat(parts, -1)  # scores: [S, Hkv, g, total]
    probs = scores.masked_fill_(invalid, float("-inf")).softmax(-1)  # probs: [S, Hkv, g, total]
    out = None
    for c0 in range(0, num_blocks, chunk_blocks):
        c1 = min(num_blocks, c0 + chunk_blocks)
        vc, vs = _load_chunk(v_cache, v_scale, block_tables, c0, c1)  # vc: [S, Hkv, n, D]
        pc = probs[..., c0 * block_size:c1 * block_size]  # pc: [S, Hkv, g, n]
        bad = invalid[..., c0 * block_size:c1 * block_size]
        if vs is not None:
            # fold the per-token V scale into the probabilities; re-zero the masked slots, whose garbage
            # scales could be inf or NaN (0 * inf = NaN)
            pc = (pc * vs.unsqueeze(2)).masked_fill_(bad, 0.0)
        else:
            # unwritten fp32/bf16 slots may hold NaN, and 0 * NaN would poison the sum
            vc.masked_fill_(bad.view(num_seqs, 1, -1, 1), 0.0)
        part = torch.matmul(pc, vc)  # part: [S, Hkv, g, D]
        out = part if out is None else out.add_(part)
    return out.view(num_seqs, num_heads, head_dim).to(q.dtype)


def _load_chunk(cache: Tensor, scale: Tensor | None, block_tables: Tensor, c0: int, c1: int
                ) -> tuple[Tensor, Tensor | None]:
    """Blocks c0..c1 of every sequence as fp32 [S, Hkv, n, D] (n = (c1 - c0) * B) and scales [S, Hkv, n]."""
    num_seqs = block_tables.shape[0]
    _, block_size, num_kv_heads, head_dim = cache.shape
    n = (c1 - c0) * block_size
    ids = block_tables[:, c0:c1].reshape(-1)
    raw = cache.index_select(0, ids).view(num_seqs, n, num_kv_heads, head_dim)  # raw: [S, n, Hkv, D]
    x = torch.empty(num_seqs, num_kv_heads, n, head_dim)
    x.copy_(raw.transpose(1, 2))  # converts to fp32 and moves heads forward in one pass
    if scale is None:
        return x, None
    s = scale.index_select(0, ids).view(num_seqs, n, num_kv_heads).transpose(1, 2)  # s: [S, Hkv, n]
    return x, s
