"""Expert parallelism: a mixture-of-experts layer over a replica group, each rank holding a run of whole experts.

    rank r holds experts [bounds[r], bounds[r + 1])   contiguous, balanced (E * r // k); each whole, in the file's
                                                      own codes (a K-quant super-block is never cut)
    router        replicated: every rank routes every token over all E experts (the same bits: the same x)
    experts       each rank runs its experts only, on the (token, slot) pairs routed to them
    combine       tp_mode "exact": all-gather the pairs' rows. Sorted by expert, the pairs of rank 0's experts come
                  first, then rank 1's, ...: the gathered rows are one rank's, in one rank's order, and each rank
                  adds them up as one rank does (bit-identical).
                  tp_mode "reduce": each rank adds up its own pairs in fp32, the partial sums are all-reduced in
                  fp32 and rounded once to bf16 (one rank adds a token's k terms in expert order in one fp32 sum;
                  here the sum is split at the rank boundary, so it differs by fp32 reassociation before the
                  rounding).

A token's k experts may all sit on one rank: the group is as fast as its busiest rank in that step (at decode
batch 1, Qwen3-30B-A3B's 8 experts of 128 split 4 + 4 only on average). Cutting each expert's intermediate width
instead would balance every step, but would cut the down projection's K-quant super-blocks (256 values along its
input) wherever moe_intermediate_size / ranks is no multiple of 256: Qwen3-30B-A3B's 768 over 2 ranks is 384.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from cpuserve.engine.distributed.communicator import Communicator
from cpuserve.engine.models.moe import MoE


class ExpertParallel(nn.Module):
    stack = None  # no ExpertStack of every expert here: the fused decode step (fused_decode.py) takes no rank's MLP

    def __init__(self, moe: MoE, comm: Communicator, bounds: list[int], exact: bool):
        """bounds: [k + 1] expert ids, rank r's experts are [bounds[r], bounds[r + 1])."""
        super().__init__()
        assert len(moe.experts) == bounds[comm.rank + 1] - bounds[comm.rank], (len(moe.experts), bounds)
        self.moe, self.comm, self.bounds, self.exact = moe, comm, bounds, exact
        moe.first_expert = bounds[comm.rank]

    def forward(self, x: Tensor, meta) -> Tensor:
        ys, routing = self.moe.expert_rows(x, meta)  # ys: [pairs routed to this rank's experts, dim]
        n, dim = x.shape
        first, stop = self.bounds[self.comm.rank], self.bounds[self.comm.rank + 1]
        if not self.exact:
            partial = self.comm.next_buffer((n, dim), torch.float32)  # built in the all-reduce's slot
            return self.comm.all_reduce(self.moe.combine(ys, routing, first, stop, out=partial)).to(x.dtype)
        start = routing.start.tolist()
        widths = [(start[b] - start[a]) * dim for a, b in zip(self.bounds, self.bounds[1:])]
        every = self.comm.all_gather_cols(ys.reshape(1, -1), widths).view(-1, dim)  # [N k, dim]: all pairs, in order
        return self.moe.combine(every, routing, 0, self.bounds[-1]).to(x.dtype)
