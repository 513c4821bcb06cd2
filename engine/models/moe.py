"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks n_experts_used of the layer's SwiGLU experts per
token, and each expert runs only on the tokens routed to it.

    router     logits = x @ W_router.T [N, E] (ops.router_logits), softmax over all E, the top k kept (ties:
               torch.topk's order), renormalised to sum 1 when norm_topk_prob (Mixtral always: that is the softmax
               of its top-k logits; Qwen3-MoE as its config says)
    grouping   the step's N * k (token, expert) pairs sorted by expert, tokens in order within each
    experts    per active expert e, one gate_up GEMM and one down GEMM over its tokens' rows x[rows_e] (the same
               QuantLinear kernels as a dense MLP, the file's own codes), so a decode step reads only the active
               experts' weights
    combine    out[t] = sum_j w[t, j] * expert_{e_j}(x[t]) in fp32, added in expert order, one rounding at the end

A token's result depends on its own row alone: its router row, its experts' rows (their GEMMs compute each row on
its own: the int8 dot products are exact at any M), and the order of its k terms (by expert id). So a request gets
the same bits batched with any others as alone. The router's weights are fp32 and its logits come from dense_gemm
(each output element summed in one fixed order, whatever the rows around it); where that kernel is not built they
are float64, multiplied in float64 and rounded to fp32, so a reduction order that changes with the batch's size
could only change a logit where the float64 sums of the two orders straddle an fp32 rounding boundary.

The router and the experts run in one C++ call a layer (ops.moe_experts, engine/csrc/moe_experts.cpp: the same torch
ops and kernels in the same order, the same bits) where their weights stack (ExpertStack: every expert's gate_up, and every down, in one int8
dot-product layout) and no row of the step takes a prompt kernel (AMX-BF16 prompt rows, act_int8.py); otherwise,
and as its reference, experts_reference runs each expert's own modules from Python.

A replica group's rank holds a contiguous run of whole experts (engine/distributed/experts.py): expert_rows routes
over every expert and runs its own, combine adds a run of experts' pairs; forward is the two over every expert.
"""
from __future__ import annotations

from bisect import bisect_left
from typing import NamedTuple

import torch
from torch import Tensor, nn

from cpuserve.engine.layers import ops
from cpuserve.engine.layers.linear.act_int8 import Int8ActLinear
from cpuserve.engine.layers.linear.coded import as_float, concat_rows
from cpuserve.engine.models.llama import MLP, AttentionMetadata

RowRanges = tuple[tuple[int, int], ...]


class Routing(NamedTuple):
    """One step's routing: the (token, slot) pairs p = t * k + j sorted by expert (tokens ascending within one)."""
    weights: Tensor  # [N, k] fp32, MoE.route's
    order: Tensor  # [N k] int64: the pairs by expert
    start: Tensor  # [E + 1] int64: expert e's pairs are order[start[e]:start[e + 1]]


class MoE(nn.Module):
    def __init__(self, router: Tensor, experts: list[MLP], n_used: int, norm_topk_prob: bool):
        super().__init__()
        self.register_buffer("router", router.to(ops.router_dtype()).contiguous())  # [E, dim]
        self.experts = nn.ModuleList(experts)
        self.first_expert = 0  # experts[0]'s id: a replica group's rank holds experts [first, first + len(experts))
        self.n_used = n_used
        self.norm_topk_prob = norm_topk_prob
        self.stack = ExpertStack.build(experts)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, dim] -> (weights [N, k] fp32, expert ids [N, k] int64)."""
        logits = ops.router_logits(x, self.router)  # logits: [N, E] fp32
        weights, chosen = torch.softmax(logits, dim=-1).topk(self.n_used, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        if self._runs_stacked(x, meta):
            return self.stack.run(x, self.router, self.n_used, self.norm_topk_prob)
        weights, chosen = self.route(x)
        return self.experts_reference(x, weights, chosen, meta.prompt_rows)

    def _runs_stacked(self, x: Tensor, meta: AttentionMetadata) -> bool:
        return self.stack is not None and x.dtype == torch.bfloat16 and not (
            meta.prompt_rows and self.experts[0].gate_up.has_prompt_kernel())

    def experts_reference(self, x: Tensor, weights: Tensor, chosen: Tensor, prompt_rows: RowRanges) -> Tensor:
        """x [N, dim], route's weights and chosen [N, k] -> [N, dim]: each active expert's own modules over its rows
        (the prompt rows among them as such), then the weighted sum."""
        routing = sort_pairs(weights, chosen, self.router.shape[0])
        ys = self._rows_reference(x, routing, prompt_rows)
        return combine_reference(ys, routing, 0, self.router.shape[0]).to(x.dtype)

    def expert_rows(self, x: Tensor, meta: AttentionMetadata) -> tuple[Tensor, Routing]:
        """A replica group rank's half of forward: route over every expert, run this module's experts only ->
        (their pairs' rows [Q, dim] in pair order, the routing); combine adds them up."""
        if self._runs_stacked(x, meta):
            ys, *routing = ops.moe_expert_rows(x.contiguous(), self.router, self.n_used, self.norm_topk_prob,
                                               self.stack.gate_up, self.stack.down, self.stack.meta,
                                               self.first_expert)
            return ys, Routing(*routing)
        routing = sort_pairs(*self.route(x), self.router.shape[0])
        return self._rows_reference(x, routing, meta.prompt_rows), routing

    def combine(self, ys: Tensor, routing: Routing, first: int, stop: int, out: Tensor | None = None) -> Tensor:
        """The fp32 sum [N, dim] of the pairs of experts [first, stop), ys their rows: into out when given."""
        if self.stack is None or ys.dtype != torch.bfloat16:
            total = combine_reference(ys, routing, first, stop)
            return total if out is None else out.copy_(total)
        out = out if out is not None else torch.empty((routing.weights.shape[0], ys.shape[1]), dtype=torch.float32)
        return ops.moe_combine(ys.contiguous(), *routing, first, stop, out)

    def _rows_reference(self, x: Tensor, routing: Routing, prompt_rows: RowRanges) -> Tensor:
        """Each of this module's experts over its pairs' rows -> [Q, dim], the pairs of its experts in order."""
        first, k = self.first_expert, self.n_used
        start = routing.start.tolist()
        tokens = routing.order[start[first]:start[first + len(self.experts)]] // k  # [Q]: each pair's token
        ys = []
        for e, expert in enumerate(self.experts):
            a, b = start[first + e] - start[first], start[first + e + 1] - start[first]
            if a == b:  # not routed to: its weights are never read
                continue
            rows = tokens[a:b]  # ascending (a token picks an expert once)
            ys.append(expert.run(x[rows], _local_ranges(rows, prompt_rows)))  # [b - a, dim]
        return torch.cat(ys) if ys else x.new_zeros((0, x.shape[1]))


def sort_pairs(weights: Tensor, chosen: Tensor, n_experts: int) -> Routing:
    """route's (weights, chosen [N, k]) as a Routing over n_experts."""
    order = torch.argsort(chosen.view(-1), stable=True)  # order: [N k], the (token, slot) pairs by expert
    counts = torch.bincount(chosen.view(-1), minlength=n_experts)
    return Routing(weights, order, torch.cat([counts.new_zeros(1), counts.cumsum(0)]))


def combine_reference(ys: Tensor, routing: Routing, first: int, stop: int) -> Tensor:
    """[N, dim] fp32: out[t] = sum over t's pairs of experts [first, stop), in expert order, of float(y) * w (one
    index_add_ an expert), ys the rows of those pairs in order."""
    weights, order, start = routing.weights, routing.order, routing.start.tolist()
    k = weights.shape[1]
    out = torch.zeros((weights.shape[0], ys.shape[1]), dtype=torch.float32)  # out: [N, dim]
    pair_weights = weights.view(-1)[order, None]  # [N k, 1]
    for e in range(first, stop):
        a, b = start[e], start[e + 1]
        if a == b:
            continue
        rows = order[a:b] // k
        out.index_add_(0, rows, ys[a - start[first]:b - start[first]].float() * pair_weights[a:b])
    return out


class ExpertStack:
    """Every expert's gate_up, and every expert's down, as one stacked tensor per buffer [E, ...] (expert e at index
    e), for ops.moe_experts; each expert's module keeps views into them (no second copy). Only where every expert's
    projection is an int8 dot-product layer (Int8ActLinear) of one layout: the same class, bits, activation group,
    buffer shapes and dtypes, no bias (a GGUF's stacked experts are one tensor type)."""

    BUFFERS = ("packed", "scales", "zoffs", "supers")

    def __init__(self, gate_up: list[Tensor | None], down: list[Tensor | None], meta: list[int]):
        self.gate_up, self.down, self.meta = gate_up, down, meta

    @classmethod
    def build(cls, experts: list[MLP]) -> "ExpertStack | None":
        if not experts or not ops.moe_experts_enabled():
            return None
        gate_ups, downs = [e.gate_up for e in experts], [e.down for e in experts]
        if not (_stackable(gate_ups) and _stackable(downs)):
            return None
        meta = [gate_ups[0].bits, gate_ups[0].act_group, downs[0].bits, downs[0].act_group]
        return cls(_stack(gate_ups), _stack(downs), meta)

    def run(self, x: Tensor, router: Tensor, n_used: int, norm_topk_prob: bool) -> Tensor:
        """MoE.route and experts_reference's bits: x [N, dim] bf16 -> [N, dim] bf16."""
        return ops.moe_experts(x.contiguous(), router, n_used, norm_topk_prob, self.gate_up, self.down, self.meta)


def _stackable(linears: list) -> bool:
    first = linears[0]
    if not isinstance(first, Int8ActLinear):
        return False
    layout = lambda lin: (type(lin), lin.bits, lin.act_group, lin.bias is None, *(  # noqa: E731
        None if t is None else (t.dtype, tuple(t.shape)) for t in (getattr(lin, b) for b in ExpertStack.BUFFERS)))
    return first.bias is None and all(type(lin) is type(first) and layout(lin) == layout(first) for lin in linears)


def _stack(linears: list[Int8ActLinear]) -> list[Tensor | None]:
    """The stacked buffers; each linear's buffers rebound to its views of them."""
    stacked = []
    for name in ExpertStack.BUFFERS:
        if getattr(linears[0], name) is None:
            stacked.append(None)
            continue
        first = getattr(linears[0], name)
        whole = first.new_empty((len(linears), *first.shape))  # whole: [E, ...]
        for e, lin in enumerate(linears):  # each expert's own buffer freed as it is copied: no second layer at load
            whole[e] = getattr(lin, name)
            lin.register_buffer(name, whole[e])
        stacked.append(whole)
    return stacked


def _local_ranges(rows: Tensor, prompt_rows: RowRanges) -> RowRanges:
    """The prompt rows among x[rows] (rows ascending) as ranges of positions in x[rows]: each range of the step's
    rows maps to one range, since the gathered rows keep their order."""
    if not prompt_rows:
        return ()
    ids = rows.tolist()
    ranges = ((bisect_left(ids, a), bisect_left(ids, b)) for a, b in prompt_rows)
    return tuple((a, b) for a, b in ranges if b > a)


def build_moe(args, parts: dict, linear) -> MoE:
    """The layer's MoE block from its tensors (loader/moe.py's names, model.layers.N. omitted); linear(name, weight)
    builds a QuantLinear the way the dense layers' are built."""
    experts = []
    for e in range(args.experts_held):  # a replica group's rank: its own, counted from 0
        p = f"mlp.experts.{e}."
        gate_up = concat_rows([parts[p + "gate_proj.weight"], parts[p + "up_proj.weight"]])  # [2 F, dim]
        experts.append(MLP(linear(f"expert {e} gate_up_proj", gate_up),
                           linear(f"expert {e} down_proj", parts[p + "down_proj.weight"])))
    return MoE(as_float(parts["mlp.gate.weight"]), experts, args.n_experts_used, args.norm_topk_prob)


def expert_parts(n_experts: int) -> list[str]:
    """The tensors of an MoE layer's MLP the builder waits for."""
    names = [f"mlp.experts.{e}.{p}_proj.weight" for e in range(n_experts) for p in ("gate", "up", "down")]
    return ["mlp.gate.weight", *names]
