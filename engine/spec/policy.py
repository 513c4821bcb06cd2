"""When speculation is worth its rows: how many draft tokens a request may have this step, and the pause after
drafts that keep failing.

A verification row costs a step as much as a decode row. At small batches a step is bound by reading the weights,
so extra rows come almost free and every accepted token saves a step; at large batches the step is compute-bound
and rejected rows are pure loss (llama.cpp's lookup decoding: 1.10x at one slot, 0.77x at eight). So:
- drafting is off in a step that runs more than max_batch requests;
- a request whose drafts were wholly rejected pause_after times in a row drafts nothing for pause_steps steps;
- a request that shares its step with others pauses the same way while the running average of the share of its
  drafts kept is below min_acceptance: alone, a request whose drafts keep a third of their tokens still gains, but
  beside others its rejected rows cost more than its kept tokens save.
The defaults (EngineConfig.spec_*) are measured with bench/speculative.py; docs/engine.md gives the figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpuserve.engine.config import EngineConfig
from cpuserve.engine.request import Request


@dataclass(slots=True)
class SpecPolicy:
    num_tokens: int  # k: draft tokens per request and step, at most
    max_batch: int
    pause_after: int
    pause_steps: int
    min_acceptance: float = 0.0
    average_weight: float = 0.25  # of the latest draft in the running average of the share kept

    @classmethod
    def from_config(cls, config: EngineConfig) -> "SpecPolicy":
        return cls(config.spec_tokens, config.spec_max_batch, config.spec_pause_after, config.spec_pause_steps,
                   config.spec_min_acceptance)

    def is_on(self, num_running: int) -> bool:
        """Drafting in a step that runs num_running requests."""
        return num_running <= self.max_batch

    def max_draft(self, request: Request, step: int, budget: int) -> int:
        """Draft tokens the request may verify this step: 0 while it prefills, pauses or is seeded; never more than
        the step's budget leaves beside its own token, nor past max_tokens or the context (all of the draft and
        the token after it may be accepted)."""
        if (request.num_computed_tokens != request.num_tokens - 1 or request.num_output_tokens == 0
                or step < request.drafts_paused_until or _is_seeded_sampling(request)):
            return 0
        params = request.params
        return max(0, min(self.num_tokens, budget - 1, params.max_tokens - request.num_output_tokens - 1,
                          request.max_model_len - request.num_tokens - 1))

    def record(self, request: Request, num_accepted: int, num_drafted: int, step: int, num_running: int) -> None:
        """After a verification of the request's draft in a step of num_running requests: pause its drafting after
        pause_after wholly rejected ones, or when it shares the step and keeps too little of its drafts. A pause
        restarts the running average, so the request tries again in full after it."""
        request.draft_acceptance += self.average_weight * (num_accepted / num_drafted - request.draft_acceptance)
        request.num_rejected_drafts = 0 if num_accepted else request.num_rejected_drafts + 1
        if (request.num_rejected_drafts >= self.pause_after
                or (num_running > 1 and request.draft_acceptance < self.min_acceptance)):
            request.num_rejected_drafts = 0
            request.draft_acceptance = 1.0
            request.drafts_paused_until = step + 1 + self.pause_steps


def _is_seeded_sampling(request: Request) -> bool:
    """A seeded, sampled request: its tokens must not depend on the batch, and whether it drafts does (max_batch,
    the prefix cache's contents); a greedy one's never do."""
    return request.params.seed is not None and not request.params.is_greedy
