"""Runs one scheduled step: builds the flattened batch, owns the KV pool tensors, samples."""

from __future__ import annotations

import torch

from cpuserve.engine.layers import native
from cpuserve.engine.layers.attention import decode_mask
from cpuserve.engine.models.args import ModelArgs
from cpuserve.engine.models.llama import AttentionMetadata, LayerKV, LlamaModel, PrefillChunk
from cpuserve.engine.models.rope import rope_tables
from cpuserve.engine.sampler import SamplerOutput, TokenLogprob, sample
from cpuserve.engine.scheduler import SchedulerOutput

KV_DTYPES = {"int8": torch.int8, "bf16": torch.bfloat16, "fp32": torch.float32}


def kv_bytes_per_token(args: ModelArgs, kv_cache: str) -> int:
    """K and V of one token in every layer; int8 adds one fp32 scale per token and KV head."""
    elements = 2 * args.n_layers * args.n_kv_heads * args.head_dim
    scales = 2 * args.n_layers * args.n_kv_heads * 4 if kv_cache == "int8" else 0
    return elements * KV_DTYPES[kv_cache].itemsize + scales


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: str, num_blocks: int, block_size: int, max_model_len: int):
        args = model.args
        self.model = model
        self.block_size = block_size
        self.cos, self.sin = rope_tables(args, max_model_len, model.dtype)  # [max_len, D] each
        shape = (num_blocks, block_size, 2 * args.n_kv_heads, args.head_dim)  # K heads then V heads
        dtype = KV_DTYPES[kv_cache]
        for layer in model.layers:  # one pool per layer, pre-allocated once and updated in place
            scale = torch.zeros(shape[:3]) if kv_cache == "int8" else None
            layer.attention.kv = LayerKV(torch.zeros(shape, dtype=dtype), scale)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> list[tuple[int, TokenLogprob | None] | None]:
        """Returns, per scheduled request, (token_id, logprob) if it samples this step, else None."""
        token_ids, meta, logit_rows, samplers = self.prepare_inputs(out)
        logits = self.model(token_ids, meta, logit_rows)  # [S, V]
        requests = [out.scheduled[i].request for i in samplers]
        result: SamplerOutput = sample(
            logits,
            [r.params for r in requests],
            [r.generator for r in requests],
            [r.all_token_ids for r in requests],
            [r.num_prompt_tokens for r in requests],
        )
        per_item: list[tuple[int, TokenLogprob | None] | None] = [None] * len(out.scheduled)
        for j, i in enumerate(samplers):
            per_item[i] = (result.token_ids[j], result.logprobs[j])
        return per_item

    @torch.inference_mode()
    def forward_logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits at every scheduled token, [N, V] float32: scoring, not sampling."""
        token_ids, meta, _, _ = self.prepare_inputs(out)
        return self.model(token_ids, meta, torch.arange(len(token_ids)))

    def prepare_inputs(self, out: SchedulerOutput):
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        logit_rows: list[int] = []
        samplers: list[int] = []
        for i, item in enumerate(out.scheduled):
            blocks = item.request.block_ids
            row, n, start = len(tokens), len(item.token_ids), item.start_pos
            tokens.extend(item.token_ids)
            positions.extend(range(start, start + n))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            if item.is_decode:  # decode
                decode_tables.append(blocks)
                decode_lens.append(start + 1)
            else:  # prefill
                num_blocks = -(-(start + n) // bs)
                prefills.append(PrefillChunk(row, n, start, torch.tensor(blocks[:num_blocks], dtype=torch.long)))
            if item.needs_sample:
                logit_rows.append(row + n - 1)
                samplers.append(i)
        pos = torch.tensor(positions, dtype=torch.long)
        lens = torch.tensor(decode_lens, dtype=torch.int32) if decode_lens else None
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            cos=self.cos[pos].unsqueeze(1),  # [N, 1, D]
            sin=self.sin[pos].unsqueeze(1),
            num_decode=len(decode_tables),
            decode_block_tables=_pad(decode_tables) if decode_tables else None,
            decode_context_lens=lens,
            # only the plain-torch decode attention reads the mask; the fused kernel stops at each context length
            decode_invalid=decode_mask(lens, bs) if decode_lens and not native.enabled() else None,
            prefills=prefills,
        )
        return torch.tensor(tokens, dtype=torch.long), meta, torch.tensor(logit_rows, dtype=torch.long), samplers


def _pad(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)  # [S, max_blocks]
