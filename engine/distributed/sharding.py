"""Rank r's shard of a Llama: which rows/columns of every weight it holds, and the model built from them.

    QKV, gate/up   column-parallel: rank r holds the output rows of its heads / its slice of the FFN
    o_proj, down   row-parallel: rank r holds the matching input columns; partial outputs are all-reduced
    embedding      vocab-parallel: rank r looks up the ids in its vocab range, zeros elsewhere, all-reduce
    lm_head        vocab-parallel: rank r computes the logits of its vocab range only (sampling reduces them)
    experts        expert-parallel (a mixture of experts): rank r holds a contiguous run of whole experts and runs
                   them on the tokens routed to them; the router is replicated (distributed/experts.py)

That is tp_mode "reduce", the issue's layout: 2 all-reduces per layer. Its row-parallel partial products come out
of the int4/int8 kernels already rounded to bf16, so the group's hidden states differ from one rank's in the last
bit, and greedy text drifts apart after a few tokens at near-ties (its logits are one rank's with exactly that
rounding added: tests/engine/test_tensor_parallel.py rebuilds them so on one rank, bit for bit). tp_mode "exact"
(the default) keeps every value bit-identical to one rank: o_proj and down are column-parallel too (rank r computes its slice of the output
features over the full input), their inputs and outputs are all-gathered (4 all-gathers per layer; each output
element is the same kernel over the same K as on one rank). The weights are split k ways in both modes.

Zero-copy: the producers of collective inputs write straight into this rank's shared-memory slot
(Communicator.next_buffer): o_proj / down, the embedding lookup, and for the exact mode's input gathers attention
and the MLP activation (the model asks o_proj / down for `input_buffer`). The exception is o_proj / down at the few
rows where torch's int4 / int8 kernels (no out=) run: there the communicator's own copy is the cheaper one.

Heads are split by KV head so each rank's attention (and KV pool) is self-contained: rank r holds KV heads
[r*Hkv//k, (r+1)*Hkv//k) and the query heads that share them. When k does not divide Hkv (SmolLM2 has 3 KV heads)
the split is uneven (2 + 1 heads for k=2): still exact, the larger shard just sets the pace of attention.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from cpuserve.engine.distributed.communicator import Communicator
from cpuserve.engine.distributed.experts import ExpertParallel
from cpuserve.engine.layers.linear.coded import CodedWeight
from cpuserve.engine.loader.moe import expert_index, renumber_expert
from cpuserve.engine.models.args import ModelArgs
from cpuserve.engine.models.builder import build_model
from cpuserve.engine.models.llama import AttentionMetadata, LlamaModel
from cpuserve.engine.models.moe import MoE

log = logging.getLogger(__name__)
FFN_ALIGN = 32  # FFN cut points on multiples of the int4 group, so both halves keep the fast kernels


@dataclasses.dataclass(frozen=True, slots=True)
class ShardPlan:
    rank: int
    world_size: int
    kv_heads: tuple[int, int]  # [start, end) of this rank's KV heads
    q_heads: tuple[int, int]
    ffn: tuple[int, int]
    vocab: tuple[int, int]
    vocab_padded: int  # every rank's logits are padded to this width so gathers have one shape
    dim: tuple[int, int]  # exact mode: this rank's output features of o_proj and down
    exact: bool
    experts: tuple[int, int] = (0, 0)  # [first, stop) of this rank's experts (a mixture of experts)

    @classmethod
    def make(cls, args: ModelArgs, rank: int, world_size: int, exact: bool = True) -> "ShardPlan":
        if args.n_kv_heads < world_size:
            raise ValueError(f"n_kv_heads={args.n_kv_heads} cannot be split over ranks={world_size}: every rank "
                             f"needs at least one KV head; use ranks <= {args.n_kv_heads}")
        if args.n_experts and args.n_experts < world_size:
            raise ValueError(f"n_experts={args.n_experts} cannot be split over ranks={world_size}: every rank holds "
                             f"at least one whole expert; use ranks <= {args.n_experts}")
        group = args.n_heads // args.n_kv_heads

        def cut(total: int, r: int, align: int = 1) -> int:
            return min(total, round(total * r / world_size / align) * align)

        kv = (cut(args.n_kv_heads, rank), cut(args.n_kv_heads, rank + 1))
        align = FFN_ALIGN if args.ffn_dim >= FFN_ALIGN * world_size else 1
        per_rank = -(-args.vocab_size // world_size)
        vocab = (min(rank * per_rank, args.vocab_size), min((rank + 1) * per_rank, args.vocab_size))
        dim_align = 16 if args.dim >= 16 * world_size else 1  # the int4 kernel wants N % 16 == 0
        return cls(rank, world_size, kv, (kv[0] * group, kv[1] * group),
                   (cut(args.ffn_dim, rank, align), cut(args.ffn_dim, rank + 1, align)), vocab, per_rank,
                   (cut(args.dim, rank, dim_align), cut(args.dim, rank + 1, dim_align)), exact,
                   (cut(args.n_experts, rank), cut(args.n_experts, rank + 1)))

    def local_args(self, args: ModelArgs) -> ModelArgs:
        """The shard's shapes: its heads, its FFN slice (or its experts, whole), its vocab rows (what the runner sizes
        the KV pool by)."""
        ffn = ({"n_local_experts": self.experts[1] - self.experts[0]} if args.n_experts
               else {"ffn_dim": self.ffn[1] - self.ffn[0]})
        return dataclasses.replace(args, n_heads=self.q_heads[1] - self.q_heads[0],
                                   n_kv_heads=self.kv_heads[1] - self.kv_heads[0], vocab_size=self.vocab_padded, **ffn)

    def slice(self, name: str, tensor: torch.Tensor, args: ModelArgs) -> torch.Tensor:
        """This rank's part of a Hugging Face Llama tensor (weights [out, in])."""
        d = args.head_dim
        (q0, q1), (k0, k1), (f0, f1), (v0, v1) = self.q_heads, self.kv_heads, self.ffn, self.vocab
        if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
            return tensor[q0 * d: q1 * d]
        if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            return tensor[k0 * d: k1 * d]
        if expert_index(name) is not None:
            return tensor  # a whole expert (ShardedCheckpoint drops the other ranks')
        if self.exact and name.endswith(("o_proj.weight", "down_proj.weight")):
            return tensor[self.dim[0]: self.dim[1]]  # column-parallel: its output features, the whole input
        if name.endswith("o_proj.weight"):
            return tensor[:, q0 * d: q1 * d]
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            return tensor[f0:f1]
        if name.endswith("down_proj.weight"):
            return tensor[:, f0:f1]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = tensor[v0:v1]  # [V_r, dim], zero-padded to vocab_padded rows
            pad = self.vocab_padded - (v1 - v0)
            return torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]) if pad else rows
        return tensor  # norms: replicated


class ShardedCheckpoint:
    """A loader Checkpoint seen through a ShardPlan: the builder streams and quantizes only this rank's part."""

    def __init__(self, checkpoint, plan: ShardPlan):
        self.full_args = checkpoint.args
        self.args = plan.local_args(checkpoint.args)
        self.tokenizer = checkpoint.tokenizer
        self.plan = plan
        self._checkpoint = checkpoint
        if checkpoint.args.n_experts:
            checkpoint.select_experts(*plan.experts)  # the others' bytes are never read
        self.num_tensors = checkpoint.num_tensors

    def iter_native_weights(self):
        """This rank's cut of every tensor; a GGUF's block-quantized ones stay CodedWeight (cut the same way), so
        every rank multiplies the file's own codes as one rank does."""
        first, stop = self.plan.experts
        for name, tensor in self._checkpoint.iter_native_weights():
            expert = expert_index(name)
            if expert is not None:  # this rank's experts, counted from 0 (a format that cannot skip the others'
                if first <= expert < stop:  # yields them too: dropped here)
                    yield renumber_expert(name, first), tensor
                continue
            cut = lambda t, name=name: self.plan.slice(name, t, self.full_args)  # noqa: E731
            yield name, tensor.slice_with(cut) if isinstance(tensor, CodedWeight) else cut(tensor).contiguous()


class RowParallel(nn.Module):
    """A row-parallel linear: this rank's partial product, summed over the group."""

    def __init__(self, linear: nn.Module, comm: Communicator):
        super().__init__()
        self.linear, self.comm = linear, comm

    def input_buffer(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        return self.linear.input_buffer(rows, dtype)  # this rank's input columns, used as they are

    def forward(self, x: torch.Tensor, prompt_rows: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
        if not self.linear.can_write_into(x.numel() // x.shape[-1]):  # it would copy: the all-reduce's is cheaper
            return self.comm.all_reduce(self.linear(x, prompt_rows=prompt_rows).contiguous())
        out = self.comm.next_buffer((*x.shape[:-1], self.linear.out_features), self.linear.act_dtype)
        return self.comm.all_reduce(self.linear(x, out=out, prompt_rows=prompt_rows))


class GatherLinear(nn.Module):
    """Exact mode: all-gather the input's columns (if sharded), this rank's output columns, all-gather those."""

    def __init__(self, linear: nn.Module, comm: Communicator, in_widths: list[int], out_widths: list[int]):
        super().__init__()
        self.linear, self.comm, self.in_widths, self.out_widths = linear, comm, in_widths, out_widths

    def input_buffer(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's input columns, built straight in the input gather's shared-memory slot (zero-copy)."""
        return self.comm.next_buffer((rows, self.in_widths[self.comm.rank]), dtype, self.in_widths)

    def forward(self, x: torch.Tensor, prompt_rows: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
        x = self.comm.all_gather_cols(x, self.in_widths)  # [N, sum(in_widths)]: the full input
        widths = self.out_widths
        if not self.linear.can_write_into(x.shape[0]):  # it would copy: the all-gather's memmove is cheaper
            return self.comm.all_gather_cols(self.linear(x, prompt_rows=prompt_rows), widths)  # [N, dim]
        out = self.comm.next_buffer((x.shape[0], widths[self.comm.rank]), self.linear.act_dtype, widths)
        return self.comm.all_gather_cols(self.linear(x, out=out, prompt_rows=prompt_rows), widths)


class ShardedLlamaModel(LlamaModel):
    """LlamaModel over a shard: same layers, vocab-parallel ends. forward returns local logits [S, vocab_padded]."""

    def setup(self, plan: ShardPlan, comm: Communicator, full_args: ModelArgs) -> "ShardedLlamaModel":
        self.plan, self.comm = plan, comm
        plans = [ShardPlan.make(full_args, r, plan.world_size, plan.exact) for r in range(plan.world_size)]
        heads = [(p.q_heads[1] - p.q_heads[0]) * full_args.head_dim for p in plans]
        ffn = [p.ffn[1] - p.ffn[0] for p in plans]
        dim = [p.dim[1] - p.dim[0] for p in plans]
        experts = [p.experts[0] for p in plans] + [full_args.n_experts]
        for layer in self.layers:  # module swap: the block's forward stays the single-rank one
            attention, mlp = layer.attention, layer.mlp
            if plan.exact:
                attention.o_proj = GatherLinear(attention.o_proj, comm, heads, dim)
            else:
                attention.o_proj = RowParallel(attention.o_proj, comm)
            if isinstance(mlp, MoE):  # whole experts: no cut linear inside
                layer.mlp = ExpertParallel(mlp, comm, experts, plan.exact)
            else:
                mlp.down = GatherLinear(mlp.down, comm, ffn, dim) if plan.exact else RowParallel(mlp.down, comm)
        return self

    def forward(self, token_ids: torch.Tensor, meta: AttentionMetadata, logit_rows: torch.Tensor) -> torch.Tensor:
        lo, hi = self.plan.vocab
        local = token_ids - lo
        outside = (local < 0) | (local >= hi - lo)
        x = self.comm.next_buffer((token_ids.shape[0], self.embed_tokens.shape[1]), self.embed_tokens.dtype)
        ids = local.masked_fill(outside, 0)
        if isinstance(self.embed_tokens, torch.Tensor):
            torch.index_select(self.embed_tokens, 0, ids, out=x)  # x: [N, dim], an embedding
        else:  # a GGUF's packed codes (engine/layers/embedding.py)
            x.copy_(self.embed(ids))
        x = self.comm.all_reduce(x.masked_fill_(outside[:, None], 0))  # exactly one rank holds each id: exact
        for layer in self.layers:
            x = layer(x, meta)
        x = self.norm(x[logit_rows])
        logits = self.lm_head(x).float()  # [S, vocab_padded]
        if hi - lo < self.plan.vocab_padded:
            logits[:, hi - lo:] = float("-inf")  # padding rows are no token
        return logits


TP_MODES = ("exact", "reduce")


def build_sharded_model(checkpoint, weights: str, group_size: int, comm: Communicator, tp_mode: str = "exact",
                        show_progress: bool = False, activations: str = "bf16") -> ShardedLlamaModel:
    """Build rank comm.rank's shard of the checkpoint's model (quantizing only its own slices)."""
    if tp_mode not in TP_MODES:
        raise ValueError(f"tp_mode={tp_mode!r} is not supported; use one of {TP_MODES}")
    plan = ShardPlan.make(checkpoint.args, comm.rank, comm.world_size, tp_mode == "exact")
    model = build_model(ShardedCheckpoint(checkpoint, plan), weights, group_size, show_progress, activations)
    model.__class__ = ShardedLlamaModel  # same modules and buffers; only forward and the o/down wrappers differ
    log.info("rank %d/%d shard (%s): q heads %s, kv heads %s, ffn %s, experts %s, vocab %s", comm.rank,
             comm.world_size, tp_mode, plan.q_heads, plan.kv_heads, plan.ffn, plan.experts, plan.vocab)
    return model.setup(plan, comm, checkpoint.args)
