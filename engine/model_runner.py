"""A single rank's runner (runner.py): builds the flattened batch, owns the KV pool tensors, samples.

A replica group's ranks each run one too, on their shard, fed the same SchedulerOutput from the wire."""

from __future__ import annotations

import torch

from cpuserve.engine import huge_pages
from cpuserve.engine.layers import ops
from cpuserve.engine.models.args import ModelArgs
from cpuserve.engine.models.llama import AttentionMetadata, LayerKV, LlamaModel, PrefillChunk
from cpuserve.engine.models.rope import rope_tables
from cpuserve.engine.outputs import ModelRunnerOutput
from cpuserve.engine.sampler import sample_scheduled
from cpuserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput

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
        self.num_threads = torch.get_num_threads()
        self.cos, self.sin = rope_tables(args, max_model_len, model.dtype)  # [max_len, D] each
        shape = (num_blocks, block_size, 2 * args.n_kv_heads, args.head_dim)  # K heads then V heads
        dtype = KV_DTYPES[kv_cache]
        self.kv_pools: list[torch.Tensor] = []  # every layer's pool tensors, block first: [num_blocks, ...]
        for layer in model.layers:  # one pool per layer, pre-allocated once (zero pages: no write yet), in place
            scale = huge_pages.zeroed(shape[:3], torch.float32) if kv_cache == "int8" else None
            layer.attention.kv = LayerKV(huge_pages.zeroed(shape, dtype), scale)
            self.kv_pools += [t for t in (layer.attention.kv.kv, scale) if t is not None]
        # populate_kv's place: 2 MiB region r of pool i is step r * len(pools) + i (the pools start 2 MiB-aligned)
        self._regions = max(-(-t.nbytes // huge_pages.HUGE) for t in self.kv_pools) * len(self.kv_pools)
        self._next_region = 0
        huge_pages.collapse([t for m in model.modules() for t in (*m.parameters(False), *m.buffers(False))])

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        token_ids, meta, logit_rows = self.prepare_inputs(out)
        return sample_scheduled(self.model(token_ids, meta, logit_rows), out.scheduled)  # logits [S, V]

    @torch.inference_mode()
    def forward_logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits at every scheduled token, [N, V] float32: scoring, not sampling."""
        token_ids, meta, _ = self.prepare_inputs(out)
        return self.model(token_ids, meta, torch.arange(len(token_ids)))

    def health(self) -> str | None:
        return None  # a single rank fails only by raising from run

    @property
    def kv_populated(self) -> bool:
        """Every pool region was faulted in by populate_kv (or this kernel cannot do it)."""
        return self._next_region >= self._regions

    def populate_kv(self) -> bool:
        """Fault in the next 2 MiB of the KV pools (huge_pages.populate), work for an engine with nothing to do: a
        request arriving meanwhile waits for one region at most. The regions go round the pools, so blocks become
        resident in about the order the block manager hands fresh ones out. Returns whether regions remain; False at
        once where the kernel cannot populate (pages then come at their first write)."""
        while self._next_region < self._regions:
            region, pool = divmod(self._next_region, len(self.kv_pools))
            self._next_region += 1
            data = self.kv_pools[pool].view(-1).view(torch.uint8)
            part = data[region * huge_pages.HUGE:(region + 1) * huge_pages.HUGE]
            if part.numel() == 0:  # a smaller pool (the scales) ends sooner
                continue
            if not huge_pages.populate(part):
                self._next_region = self._regions  # not on this kernel: stop asking
            break
        return not self.kv_populated

    def close(self) -> None:
        pass

    def prepare_inputs(self, out: SchedulerOutput) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(token ids [N], attention metadata, logit rows [R]: the last row of each item that samples, and the rows of
        its draft before it)."""
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        logit_rows: list[int] = []
        for item in out.scheduled:
            blocks = item.block_ids
            row, n, start = len(tokens), len(item.token_ids), item.start_pos
            tokens.extend(item.token_ids)
            positions.extend(item.positions)
            slots.extend(blocks[p // bs] * bs + p % bs for p in item.positions)
            if item.is_decode:  # a decode, or the last token and a draft: one decode row per position, each
                # attending to the keys up to its own (written by the same step first), as a one-token decode would
                decode_tables.extend([blocks] * n)
                decode_lens.extend(p + 1 for p in item.positions)
            else:  # a prefill chunk: its blocks cover exactly positions [0, start + n)
                prefills.append(PrefillChunk(row, n, start, torch.tensor(blocks, dtype=torch.long)))
            logit_rows.extend(range(row + n - item.num_logit_rows, row + n))
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
            decode_invalid=ops.prepare_decode_mask(lens, bs) if decode_lens else None,
            prefills=prefills,
            positions=pos,
            prompt_rows=prompt_row_ranges(out.scheduled),
        )
        return torch.tensor(tokens, dtype=torch.long), meta, torch.tensor(logit_rows, dtype=torch.long)


def prompt_row_ranges(scheduled: list[ScheduledRequest]) -> tuple[tuple[int, int], ...]:
    """The rows of the flattened step that hold prompt tokens, as [start, stop) ranges, adjacent ones merged.

    Each item's prompt tokens are its first rows (num_scheduled_prompt_tokens of them): all of a prompt's chunk, the
    prompt part of a preempted request's recompute (b), a one-token prompt or rest of one (one: a prefill chunk of one
    row, see ScheduledRequest.is_decode); never a decode.

        rows    | d0 d1 | one | prompt chunk a | b: prompt | b: generated | prompt chunk c |
        ranges          [----------------------------------)              [----------------)
    """
    ranges: list[tuple[int, int]] = []
    row = 0
    for item in scheduled:
        stop = row + item.num_scheduled_prompt_tokens
        if stop > row and ranges and ranges[-1][1] == row:
            ranges[-1] = (ranges[-1][0], stop)
        elif stop > row:
            ranges.append((row, stop))
        row += len(item.token_ids)
    return tuple(ranges)


def _pad(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)  # [S, max_blocks]
