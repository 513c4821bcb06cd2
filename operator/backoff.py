"""Backoff after the API server refused child writes: one window per LLMService that every handler respects
(change retries, the drift timer, pod events), so a refusal is retried ever later instead of on every event.
A new generation (a spec change) runs at once and starts the count again: the change may be the fix."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Backoff:
    base_seconds: float
    max_seconds: float
    _state: dict[str, tuple[int, float, int]] = field(default_factory=dict)
    """LLMService key -> (refused passes in a row, monotonic time before which no pass runs, generation)."""

    def delay(self, refusals: int) -> float:
        """Seconds to wait after `refusals` refused passes in a row (1 = the first): doubling, capped."""
        return min(self.base_seconds * 2 ** min(refusals - 1, 30), self.max_seconds)

    def _refusals(self, key: str, generation: int) -> tuple[int, float]:
        refusals, not_before, gen = self._state.get(key, (0, 0.0, generation))
        return (refusals, not_before) if gen == generation else (0, 0.0)

    def remaining(self, key: str, now: float, generation: int = 1) -> float:
        """Seconds until `key` at `generation` may run a pass again (0: now)."""
        return max(self._refusals(key, generation)[1] - now, 0.0)

    def refused(self, key: str, now: float, generation: int = 1) -> float:
        """Record a refused pass; returns the delay before the next one."""
        refusals = self._refusals(key, generation)[0] + 1
        delay = self.delay(refusals)
        self._state[key] = (refusals, now + delay, generation)
        return delay

    def succeeded(self, key: str) -> None:
        self._state.pop(key, None)
