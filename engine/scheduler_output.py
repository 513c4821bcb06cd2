"""What the scheduler hands the runner for one step: plain values, never the live Request.

    scheduler.schedule() -> SchedulerOutput -> runner.run() -> ModelRunnerOutput -> scheduler.postprocess()

A ScheduledRequest carries everything a runner needs to compute its chunk (token ids, positions, block ids, how many
of its tokens are prompt tokens) and, when the chunk ends at the sequence's last token, to sample the next one
(SamplingInputs). A request with a draft (engine/spec/) runs its last token and the draft tokens as one chunk of
decode rows, each of which samples: its rows' logits verify the draft. A replica group's
worker ranks rebuild the same items from the broadcast wire (distributed/step.py), without sampling inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cpuserve.engine.request import Request
from cpuserve.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingInputs:
    """What the sampler reads of one sequence."""

    params: SamplingParams
    generator: object  # the request's torch.Generator: a seeded request draws only from its own
    history: list[int]  # prompt + output so far, for the penalties; read during the step, never written
    num_prompt_tokens: int  # where the output starts in history (the presence penalty counts output only)
    grammar: object = None  # the request's llguidance matcher when its output is constrained (engine/grammar.py)


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # tokens whose KV this step computes
    start_pos: int  # position of token_ids[0] in the sequence
    needs_sample: bool  # the chunk ends at the sequence's last token: the step yields one new token
    block_ids: list[int]  # the blocks holding positions [0, start_pos + len(token_ids))
    # the first this many of token_ids are prompt tokens (positions below the request's prompt length), the rest
    # generated ones (a preempted request recomputing them): the runner picks each row's GEMM scheme by this role
    num_scheduled_prompt_tokens: int
    sampling: SamplingInputs | None = None  # set when needs_sample (on rank 0)
    # the last this many of token_ids are draft tokens (engine/spec/): the chunk is the sequence's last token and a
    # draft, every row a decode row whose logits are sampled
    num_draft_tokens: int = 0

    @classmethod
    def of(cls, request: Request, num_tokens: int, block_size: int, draft: list[int] = ()) -> "ScheduledRequest":
        """The next `num_tokens` of `request` followed by `draft` (only after its last token), whose block table
        already covers them all."""
        start = request.num_computed_tokens
        end = start + num_tokens
        needs_sample = end == request.num_tokens
        assert needs_sample or not draft, "a draft follows the sequence's last token"
        num_blocks = -(-(end + len(draft)) // block_size)
        num_prompt = max(0, min(end, request.num_prompt_tokens) - start)
        sampling = SamplingInputs(request.params, request.generator, request.all_token_ids,
                                  request.num_prompt_tokens, request.grammar) if needs_sample else None
        return cls(request.request_id, request.all_token_ids[start:end] + list(draft), start, needs_sample,
                   request.block_ids[:num_blocks], num_prompt, sampling, len(draft))

    @property
    def is_decode(self) -> bool:
        """Decode rows only: one generated token, or the last one and a draft. A prompt token always runs prefill
        attention, even alone (a prompt's last token after a prefix-cache hit), so its KV and logits never depend on
        what the cache held: on AMX CPUs the two attentions round differently (bf16 products against the int8 K
        decode reads)."""
        return len(self.token_ids) - self.num_draft_tokens == 1 and self.num_scheduled_prompt_tokens == 0

    @property
    def num_logit_rows(self) -> int:
        """Rows of the step's logits this item samples from: its last row, and one per draft token before it."""
        return 1 + self.num_draft_tokens if self.needs_sample else 0

    @property
    def draft(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:]

    @property
    def positions(self) -> range:
        return range(self.start_pos, self.start_pos + len(self.token_ids))


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # decodes first, then prefill chunks
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended by the scheduler itself (no KV room ever)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def samplers(self) -> list[ScheduledRequest]:
        """The items that sample this step, in order, each owning its num_logit_rows rows of the step's logits."""
        return [s for s in self.scheduled if s.needs_sample]

    @property
    def has_drafts(self) -> bool:
        return any(s.num_draft_tokens for s in self.scheduled)
