"""The Llama family (Llama 2/3, Mistral, SmolLM, TinyLlama; Qwen2 with qkv bias; Qwen3 with q/k norms; Phi-3,
whose fused projections the loaders split) over a paged KV pool.

Tokens of all sequences in a step are flattened into one batch [N, dim]: decodes first (one token each),
then prefill chunks. Linear layers see the whole batch; attention splits it by sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cpuserve.engine.layers import ops
from cpuserve.engine.layers.embedding import CodedEmbedding
from cpuserve.engine.layers.kv_quant import LayerKV
from cpuserve.engine.layers.linear import QuantLinear
from cpuserve.engine.models.args import ModelArgs
from cpuserve.engine.models.fused_decode import FusedDecode


@dataclass(slots=True)
class PrefillChunk:
    token_start: int  # first row of this chunk in the flattened batch
    num_tokens: int
    q_start: int  # position of the chunk's first token in its sequence
    block_table: torch.Tensor  # [num_blocks] int64


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] int64: block_id * block_size + offset of every token
    cos: torch.Tensor  # [N, 1, D] at each token's position
    sin: torch.Tensor  # [N, 1, D]
    # rows [0, num_decode) are decode rows: one per sequence, or one per position of a sequence's last token and draft
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [num_decode] int32, up to and including the row's own token
    # decode_mask(decode_context_lens, B) for every layer; None: fused kernels (= ops.prepare_decode_mask)
    decode_invalid: torch.Tensor | None
    prefills: list[PrefillChunk]
    positions: torch.Tensor | None = None  # [N] int64, each token's position (Gemma 3's per-layer RoPE reads it)
    # [start, stop) ranges of the rows that are prompt tokens: the linear layers compute them in their prompt scheme,
    # every other row in the usual one (QuantLinear.forward), so a row's bits depend on its role, never on the batch
    prompt_rows: tuple[tuple[int, int], ...] = ()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, qkv: QuantLinear, o_proj: QuantLinear):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.scale = args.head_dim ** -0.5
        self.qkv = qkv  # q, k and v projections fused into one matmul
        self.o_proj = o_proj
        self.kv: LayerKV | None = None  # bound by the runner once the pool exists
        self.int8_keys = False  # the builder's: activations are int8, so prefill's Q K^T may run in int8 (ops.py)
        # Qwen3: per-head RMSNorm of q and k (weights [D], shared by the heads); the builder sets the weights
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps, torch.float32) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps, torch.float32) if args.qk_norm else None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        h, hkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv(x, prompt_rows=meta.prompt_rows).view(n, h + 2 * hkv, d)  # qkv: [N, H + 2 Hkv, D]
        if self.q_norm is not None:
            qkv[:, :h] = self.q_norm(qkv[:, :h])
            qkv[:, h:h + hkv] = self.k_norm(qkv[:, h:h + hkv])
        kv = self.kv
        ops.rope_write_kv(qkv, meta.cos, meta.sin, h, kv, meta.slot_mapping)  # RoPE on q and k, K and V into the pool
        q = qkv[:, :h]  # q: [N, H, D]
        # o_proj's input [N, H * D], written in place: in a replica group, its gather's shared-memory slot
        # (zero-copy; the collective wants that very tensor back)
        buf = self.o_proj.input_buffer(n, q.dtype)
        out = buf.view(n, h, d)  # out: [N, H, D]
        if meta.num_decode:  # decode
            ops.decode_attention(q[: meta.num_decode], kv, meta.decode_block_tables, meta.decode_context_lens,
                                 self.scale, out[: meta.num_decode], meta.decode_invalid)
        for p in meta.prefills:  # prefill: read the context back from the pool, as a later chunk would
            length = p.q_start + p.num_tokens
            k_ctx, k_scale, v_ctx = ops.prefill_context(kv, p.block_table, length, q.dtype, self.int8_keys)
            rows = slice(p.token_start, p.token_start + p.num_tokens)
            ops.prefill_attention(q[rows], k_ctx, v_ctx, p.q_start, self.scale, k_scale=k_scale, out=out[rows])
        return self.o_proj(buf, prompt_rows=meta.prompt_rows)


class MLP(nn.Module):
    def __init__(self, gate_up: QuantLinear, down: QuantLinear):
        super().__init__()
        self.gate_up = gate_up  # gate and up projections fused into one matmul
        self.down = down

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.run(x, meta.prompt_rows)

    def run(self, x: torch.Tensor, prompt_rows: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """x [N, dim] -> [N, dim]; prompt_rows: the rows of x that are prompt tokens (AttentionMetadata's)."""
        # the kernels write straight into down's input buffer: in a replica group, its gather's shared-memory slot
        if prompt_rows and isinstance(self.gate_up, QuantLinear) and self.gate_up.has_prompt_silu_kernel():
            act = self.down.input_buffer(x.shape[0], self.gate_up.act_dtype)
            act = self.gate_up.silu_mul_into(x, act, prompt_rows)
        else:
            act = ops.silu_mul(self.gate_up(x, prompt_rows=prompt_rows), self.down.input_buffer)
        return self.down(act, prompt_rows=prompt_rows)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, attention: Attention, mlp: MLP, dtype: torch.dtype):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.attention = attention
        self.mlp = mlp

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.run(x, self.attention_norm(x), meta, None)[0]

    def run(self, x: torch.Tensor, normed: torch.Tensor, meta: AttentionMetadata,
            next_norm: RMSNorm | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward's arithmetic with each residual add fused to the norm after it: x and attention_norm(x) in;
        out, and next_norm(out) where given (the next layer's attention_norm), out. The bits of forward."""
        h, h_normed = ops.add_rms_norm(x, self.attention(normed, meta), self.ffn_norm.weight, self.ffn_norm.eps)
        delta = self.mlp(h_normed, meta)
        if next_norm is None:
            return h + delta, None
        return ops.add_rms_norm(h, delta, next_norm.weight, next_norm.eps)


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, embedding: torch.Tensor | CodedEmbedding, layers: list[TransformerBlock],
                 lm_head: QuantLinear, dtype: torch.dtype):
        super().__init__()
        self.args = args
        self.dtype = dtype
        # [V, dim] in the activation dtype, or a GGUF's packed codes (engine/layers/embedding.py)
        self.embed_tokens = embedding if isinstance(embedding, CodedEmbedding) else nn.Parameter(embedding,
                                                                                                 requires_grad=False)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.lm_head = lm_head
        self._fused: FusedDecode | None | bool = False  # False: not built yet (the KV pools are bound later)

    def forward(self, token_ids: torch.Tensor, meta: AttentionMetadata, logit_rows: torch.Tensor) -> torch.Tensor:
        """token_ids [N]; logit_rows [S]: the rows whose next-token logits are wanted. Returns [S, V] float32."""
        x = self.embed(token_ids)  # x: [N, dim]
        # decode rows only (no prompt token, not even a one-token rest of a prompt): every layer in one C++ call, the
        # op-by-op path's bits
        fused = self.fused_decode() if not (meta.prefills or meta.prompt_rows) else None
        if fused is not None:
            x = fused.run(x, meta)
        else:
            normed = self.layers[0].attention_norm(x) if len(self.layers) else None
            for i, layer in enumerate(self.layers):
                last = i + 1 == len(self.layers)
                x, normed = layer.run(x, normed, meta, None if last else self.layers[i + 1].attention_norm)
        x = self.norm(x[logit_rows])  # only the rows that sample: prefill rows before the last need no logits
        return self.lm_head(x).float()  # no prompt_rows: the lm_head never takes the prompt scheme

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed_tokens, CodedEmbedding):
            return self.embed_tokens(token_ids)
        return F.embedding(token_ids, self.embed_tokens)

    def fused_decode(self) -> FusedDecode | None:
        """fused_decode.py's step for this model, built on first use; None where it does not apply."""
        if self._fused is False or (self._fused is not None and not self._fused.binds(self)):
            self._fused = FusedDecode.build(self)
        return self._fused
