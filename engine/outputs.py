"""What the engine hands back: per-step deltas for streaming and whole results for the offline API.

Plain data, no torch: serving's ingress imports these."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    """One sampled token's log-probability under the model's raw distribution, and its top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely alternatives, best first


@dataclass(slots=True)
class StepOutput:
    """One request's progress in one engine step (a streaming chunk)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" when finished
    num_prompt_tokens: int
    num_generated_tokens: int
    num_cached_tokens: int = 0
    queue_time: float | None = None  # seconds from arrival to first scheduling, on the first chunk only
    # speculative decoding, so far: draft tokens verified, and of those accepted (part of new_token_ids' counts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def merge(self, later: "StepOutput") -> "StepOutput":
        """This chunk followed by a later one of the same request, as one chunk."""
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            (self.logprobs or []) + (later.logprobs or [])
        return StepOutput(
            self.request_id, self.new_token_ids + later.new_token_ids, self.new_text + later.new_text, logprobs,
            later.finished, later.finish_reason, later.num_prompt_tokens, later.num_generated_tokens,
            later.num_cached_tokens, self.queue_time if self.queue_time is not None else later.queue_time,
            later.num_draft_tokens, later.num_accepted_tokens)


@dataclass(slots=True)
class RequestOutput:
    """A finished request, as `LLM.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted

    def add(self, chunk: StepOutput) -> None:
        self.text += chunk.new_text
        self.token_ids.extend(chunk.new_token_ids)
        if chunk.logprobs is not None:
            self.logprobs = (self.logprobs or []) + chunk.logprobs
        self.finish_reason = chunk.finish_reason
        self.num_cached_tokens = chunk.num_cached_tokens
        self.num_draft_tokens, self.num_accepted_tokens = chunk.num_draft_tokens, chunk.num_accepted_tokens


@dataclass(slots=True)
class ModelRunnerOutput:
    """What a runner hands back for one step: per scheduled item, in order, its new tokens (none for a prefill chunk
    that samples nothing; one for a decode; the accepted draft tokens and the token after them for a draft, see
    engine/spec/verify.py) and each token's logprob when the request asked for them (else None)."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob | None]]

    @classmethod
    def place(cls, scheduled: list, token_ids: list[int], logprobs: list[TokenLogprob | None]) -> "ModelRunnerOutput":
        """Spread one token per sampling item over every scheduled item (a step without drafts)."""
        return cls.place_lists(scheduled, [[t] for t in token_ids], [[lp] for lp in logprobs])

    @classmethod
    def place_lists(cls, scheduled: list, token_ids: list[list[int]], logprobs: list[list[TokenLogprob | None]]
                    ) -> "ModelRunnerOutput":
        """Spread one list of new tokens per sampling item over every scheduled item."""
        out = cls([[] for _ in scheduled], [[] for _ in scheduled])
        row = 0
        for i, item in enumerate(scheduled):
            if item.needs_sample:
                out.token_ids[i], out.logprobs[i] = token_ids[row], logprobs[row]
                row += 1
        return out
