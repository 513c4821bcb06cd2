"""One generation request as the scheduler sees it: counters, not phases."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from cpuserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered so that `is_finished` is one comparison."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 30
    priority: int = 0  # lower runs first
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of those, taken from the prefix cache at admission
    block_ids: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks of block_ids registered in the prefix cache (block_manager.py)
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    generator: object = None  # the runner's per-request RNG (a torch.Generator); opaque here
    grammar: object = None  # an llguidance matcher when params.structured_output is set (engine/grammar.py)
    # speculative decoding (engine/spec/): draft tokens verified and accepted so far, and the drafting pause
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rejected_drafts: int = 0  # verifications in a row that accepted no draft token
    drafts_paused_until: int = 0  # the scheduler's step number from which this request may draft again
    draft_acceptance: float = 1.0  # running average of the share of each draft kept (SpecPolicy.record)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
