"""Gemma 3 (text): the Llama layout plus sliding-window layers, extra norms, GeLU and a scaled embedding.

    - Local layers (args.sliding_window.layers[i]) attend to the last `size` tokens only, with their own RoPE base;
      global ones (every 6th in Gemma 3) to the whole context, with the model's base (and linear scaling if any).
    - Four norms per block: input, post-attention, pre- and post-feed-forward. Gemma's RMSNorm multiplies by
      (1 + weight): both loaders hand over that multiplier (llama.cpp's files store it so), so ops.rms_norm serves.
    - q and k are RMS-normed per head before RoPE; the softmax scale is query_pre_attn_scalar ** -0.5.
    - MLP: gelu_tanh(gate) * up; the embedding is multiplied by sqrt(dim) (the builder folds it into the table).

The KV pool keeps every token for every layer: the global layers read the whole context, so no block ever falls
out of every layer's window (the local layers simply read less of it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cpuserve.engine.layers import ops
from cpuserve.engine.layers.linear import QuantLinear
from cpuserve.engine.models.args import ModelArgs
from cpuserve.engine.models.llama import MLP, Attention, AttentionMetadata, LlamaModel, PrefillChunk, RMSNorm
from cpuserve.engine.models.rope import inv_frequencies, rope_at

# The C++ SlimAttention's key block: a local layer's context is cut at a multiple of it, so a row's sums do not
# depend on where its chunk started (a prompt prefilled whole or in chunks gives bit-identical rows).
WINDOW_ALIGN = 256

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [N, 1, D] at each token's position


class Gemma3Attention(Attention):
    def __init__(self, args: ModelArgs, qkv: QuantLinear, o_proj: QuantLinear, window: int):
        super().__init__(args, qkv, o_proj)
        self.scale = args.attn_scale
        self.window = window  # 0: a global layer

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, rope: Rope, decode_invalid) -> torch.Tensor:
        n = x.shape[0]
        h, hkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv(x, prompt_rows=meta.prompt_rows).view(n, h + 2 * hkv, d)  # qkv: [N, H + 2 Hkv, D]
        qkv[:, :h] = self.q_norm(qkv[:, :h])
        qkv[:, h:h + hkv] = self.k_norm(qkv[:, h:h + hkv])
        kv = self.kv
        ops.rope_write_kv(qkv, rope[0], rope[1], h, kv, meta.slot_mapping)
        q = qkv[:, :h]  # q: [N, H, D]
        buf = self.o_proj.input_buffer(n, q.dtype)
        out = buf.view(n, h, d)  # out: [N, H, D]
        if meta.num_decode:  # decode
            ops.decode_attention(q[: meta.num_decode], kv, meta.decode_block_tables, meta.decode_context_lens,
                                 self.scale, out[: meta.num_decode], decode_invalid, self.window)
        for p in meta.prefills:  # prefill
            rows = slice(p.token_start, p.token_start + p.num_tokens)
            self._prefill(q[rows], p, out[rows])
        return self.o_proj(buf, prompt_rows=meta.prompt_rows)

    def _prefill(self, q: torch.Tensor, p: PrefillChunk, out: torch.Tensor) -> torch.Tensor:
        """The chunk's rows against the context read back from the pool, into out; a local layer reads only from the
        aligned start of its first row's window."""
        kv, block_size = self.kv, self.kv.kv.shape[1]
        first = 0
        if self.window:
            align = max(WINDOW_ALIGN, block_size)  # both powers of two: a whole number of blocks
            first = max(0, p.q_start + 1 - self.window) // align * align
        length = p.q_start + p.num_tokens - first
        table = p.block_table[first // block_size:]
        # each [T, Hkv, D], positions from `first` on
        k_ctx, k_scale, v_ctx = ops.prefill_context(kv, table, length, q.dtype, self.int8_keys)
        return ops.prefill_attention(q, k_ctx, v_ctx, p.q_start - first, self.scale, self.window, k_scale, out)


class Gemma3MLP(MLP):
    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        gate, up = self.gate_up(x, prompt_rows=meta.prompt_rows).chunk(2, dim=-1)
        return self.down(F.gelu(gate, approximate="tanh") * up, prompt_rows=meta.prompt_rows)


class Gemma3Block(nn.Module):
    def __init__(self, args: ModelArgs, attention: Gemma3Attention, mlp: Gemma3MLP, dtype: torch.dtype):
        super().__init__()
        norm = lambda: RMSNorm(args.dim, args.norm_eps, dtype)  # noqa: E731 - four of them
        self.input_norm, self.post_attention_norm = norm(), norm()
        self.pre_ffn_norm, self.post_ffn_norm = norm(), norm()
        self.attention = attention
        self.mlp = mlp

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, rope: Rope, decode_invalid) -> torch.Tensor:
        h = x + self.post_attention_norm(self.attention(self.input_norm(x), meta, rope, decode_invalid))
        return h + self.post_ffn_norm(self.mlp(self.pre_ffn_norm(h), meta))


class Gemma3Model(LlamaModel):
    def __init__(self, args: ModelArgs, embedding: torch.Tensor, layers: list[Gemma3Block], lm_head: QuantLinear,
                 dtype: torch.dtype):
        super().__init__(args, embedding, layers, lm_head, dtype)
        window = args.sliding_window
        self.window = window.size
        # the local layers' RoPE: their own base, never scaled (the model's tables, meta.cos/sin, are the global's)
        self.register_buffer("local_inv_freq", inv_frequencies(args, window.rope_theta, 1.0), persistent=False)

    def forward(self, token_ids: torch.Tensor, meta: AttentionMetadata, logit_rows: torch.Tensor) -> torch.Tensor:
        """As LlamaModel.forward; the embedding is already multiplied by sqrt(dim) (builder.py)."""
        x = self.embed(token_ids)  # x: [N, dim]
        cos, sin = rope_at(meta.positions, self.local_inv_freq, self.dtype)
        ropes = {0: (meta.cos, meta.sin), self.window: (cos.unsqueeze(1), sin.unsqueeze(1))}
        invalid = {0: meta.decode_invalid, self.window: None}
        if meta.num_decode:  # the plain-torch decode's mask of the local layers (None when the kernel runs)
            block_size = self.layers[0].attention.kv.kv.shape[1]
            invalid[self.window] = ops.prepare_decode_mask(meta.decode_context_lens, block_size, self.window)
        for layer in self.layers:
            w = layer.attention.window
            x = layer(x, meta, ropes[w], invalid[w])
        x = self.norm(x[logit_rows])
        return self.lm_head(x).float()


def build_block(args: ModelArgs, index: int, qkv: QuantLinear, o_proj: QuantLinear, gate_up: QuantLinear,
                down: QuantLinear, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> Gemma3Block:
    """Layer `index` from its linear layers and the norms of `parts` (HF names, weights as (1 + w))."""
    window = args.sliding_window.size if args.sliding_window.layers[index] else 0
    attention = Gemma3Attention(args, qkv, o_proj, window)
    attention.q_norm.weight.data = parts["self_attn.q_norm.weight"].to(dtype)
    attention.k_norm.weight.data = parts["self_attn.k_norm.weight"].to(dtype)
    block = Gemma3Block(args, attention, Gemma3MLP(gate_up, down), dtype)
    for norm, name in ((block.input_norm, "input_layernorm"), (block.post_attention_norm, "post_attention_layernorm"),
                       (block.pre_ffn_norm, "pre_feedforward_layernorm"),
                       (block.post_ffn_norm, "post_feedforward_layernorm")):
        norm.weight.data = parts[f"{name}.weight"].to(dtype)
    return block
