"""One engine step on a replica group: the wire format rank 0 broadcasts, and the reduced top-k sampling.

Wire (one int64 vector, so a step costs one broadcast):

    [kind, num_candidates, num_items,
     then per scheduled item: num_tokens, start_pos, needs_sample, num_blocks, num_scheduled_prompt_tokens,
     num_draft_tokens, *token_ids, *block_ids]

KIND_POPULATE, with no items, is idle work instead of a step: every rank faults in the next 2 MiB of its KV pools
(ModelRunner.populate_kv) and rank 0 gathers, in the place of logits, whether any rank has more left.

Every rank (rank 0 included) rebuilds the step from the wire and runs the runner's own prepare_inputs on it,
so all ranks feed their shard exactly the same positions, slots, block tables and logit rows.

Sampling: each rank takes the top num_candidates logits of its vocab shard; rank 0 gathers them and hands them to
the sampler (sampler.sample_candidates: the candidates in a -inf row of the full vocab, then the one sampling path
of every runner, sample_scheduled). That is exact when every row's pick depends on its global top num_candidates
logits only; the sampler says how many each row needs (sampler.num_top_logits: greedy 1, top-k k, and the whole
row for a logit bias, a penalty, a grammar, logprobs, top-p or min-p without top-k), and a step with any whole-row
request gathers the full shards (num_candidates = FULL). Rank 0 draws from that full-vocab row with the request's
generator, as one rank does, so seeded streams match a single rank's.
"""

from __future__ import annotations

import torch

from cpuserve.engine.sampler import WHOLE_ROW, num_top_logits, top_k_ids
from cpuserve.engine.scheduler_output import SamplingInputs, ScheduledRequest, SchedulerOutput

KIND_STOP, KIND_SAMPLE, KIND_SCORE, KIND_POPULATE = 0, 1, 2, 3
FULL = WHOLE_ROW  # num_candidates meaning "gather the whole shard"


def num_candidates(inputs: list[SamplingInputs], vocab_per_rank: int) -> int:
    """Per-rank candidates that hold every logit the sampler reads this step; FULL when nothing smaller does."""
    needs = [num_top_logits(i) for i in inputs]
    if WHOLE_ROW in needs:
        return FULL
    need = max(needs, default=1)
    return FULL if need >= vocab_per_rank else need


def pack(out: SchedulerOutput, kind: int, candidates: int) -> torch.Tensor:
    wire = [kind, candidates, len(out.scheduled)]
    for item in out.scheduled:
        wire += [len(item.token_ids), item.start_pos, int(item.needs_sample), len(item.block_ids),
                 item.num_scheduled_prompt_tokens, item.num_draft_tokens]
        wire += item.token_ids
        wire += item.block_ids
    return torch.tensor(wire, dtype=torch.int64)


def unpack(wire: torch.Tensor) -> tuple[int, int, SchedulerOutput]:
    """(kind, num_candidates, the SchedulerOutput rank 0 packed, without ids or sampling inputs)."""
    w = wire.tolist()
    kind, candidates, num_items = w[0], w[1], w[2]
    scheduled, i = [], 3
    for _ in range(num_items):
        n, start, needs_sample, nb, num_prompt, num_draft = w[i: i + 6]
        i += 6
        tokens, blocks = w[i: i + n], w[i + n: i + n + nb]
        i += n + nb
        scheduled.append(ScheduledRequest("", tokens, start, bool(needs_sample), blocks, num_prompt,
                                          num_draft_tokens=num_draft))
    return kind, candidates, SchedulerOutput(scheduled)


def local_candidates(logits: torch.Tensor, k: int, vocab_start: int) -> torch.Tensor:
    """[S, 2k] float32: this shard's top-k values, then their global token ids (exact in fp32 below 2**24). Among equal
    logits the lowest ids come first, as the sampler's top-k takes them: the union of the shards' candidates then
    holds a row's global top k."""
    ids = top_k_ids(logits, k)  # [S, k]
    values = logits.gather(-1, ids)
    return torch.cat([values, (ids + vocab_start).float()], dim=-1)


def split_candidates(gathered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gathered [ranks, S, 2k] -> (values [S, ranks*k] float32, global token ids [S, ranks*k] int64)."""
    ranks, s, two_k = gathered.shape
    k = two_k // 2
    per_row = gathered.permute(1, 0, 2).reshape(s, ranks, 2, k)  # [S, ranks, values|ids, k]
    return per_row[:, :, 0].reshape(s, ranks * k), per_row[:, :, 1].reshape(s, ranks * k).long()


def dense_from_shards(gathered: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """gathered [ranks, S, V_pad] (rank r holds ids [r*V_pad, (r+1)*V_pad)) -> [S, V] float32."""
    ranks, s, v_pad = gathered.shape
    return gathered.permute(1, 0, 2).reshape(s, ranks * v_pad)[:, :vocab_size]  # [S, V]
