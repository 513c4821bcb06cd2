"""Per-request sampling parameters, validated at the public boundary."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cpuserve.engine.errors import InvalidRequest
from cpuserve.engine.grammar import StructuredOutput, grammar_of


SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what a torch.Generator's manual_seed takes


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens for one request. temperature 0 means greedy (argmax)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0  # subtracted once per earlier occurrence of the token in the output
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, in [-100, 100]
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return per token; 0 = only the chosen token
    skip_special_tokens: bool = True
    # the output follows a JSON schema, a regex or a grammar (engine/grammar.py); None = free text
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", self.max_tokens, "an integer >= 1")
        _check(_finite(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
               "a finite number >= 0 (0 = greedy)")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k, "an integer >= 0 (0 = off)")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               self.repetition_penalty, "a finite number > 0 (1 = off)")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        _check(isinstance(self.logit_bias, dict) and all(
            isinstance(t, int) and t >= 0 and isinstance(b, (int, float)) and -100 <= b <= 100
            for t, b in self.logit_bias.items()), "logit_bias", self.logit_bias, "{token id >= 0: bias in [-100, 100]}")
        _check(self.seed is None or isinstance(self.seed, int) and SEED_MIN <= self.seed <= SEED_MAX, "seed", self.seed,
               f"None or an integer in [{SEED_MIN}, {SEED_MAX}]")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs, "None or in [0, 20]")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "a list of non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "a list of token ids >= 0")
        if self.structured_output is not None:
            try:
                self.structured_output = StructuredOutput.of(self.structured_output)
            except TypeError:
                raise InvalidRequest("structured_output", "structured_output must be {'kind': ..., 'spec': ...}") from None
            grammar_of(self.structured_output.kind, self.structured_output.spec)  # cached; raises for a bad spec

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise InvalidRequest(name, f"{name}={value!r} is invalid: must be {allowed}")
