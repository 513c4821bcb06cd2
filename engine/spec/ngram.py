"""The n-gram drafter: the tokens that followed the request's last n tokens elsewhere, no model needed.

For n from n_max down to n_min, the last n tokens of the request are looked up (a) in the request's own prompt and
output (the latest earlier occurrence, as llama.cpp's ngram-simple and vLLM's prompt lookup do) and (b) in the
prefix cache's blocks (block_index.py), so text any request sent can be drafted for another. The first hit gives
the draft: the tokens that came after it, up to the number asked for.

(a) keeps, per request, a dict from each n-gram's hash to the position after its latest occurrence, extended by the
tokens added since the last call: O(new tokens) a step, not a scan of the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cpuserve.engine.request import Request
from cpuserve.engine.spec.block_index import BlockIndex


@dataclass(slots=True)
class _ContextIndex:
    num_indexed: int = 0  # n-grams ending at positions below this are in `ends`
    ends: dict[int, int] = field(default_factory=dict)  # hash(n-gram) -> position right after its latest occurrence


class NgramDrafter:
    def __init__(self, n_min: int, n_max: int, block_index: BlockIndex | None = None):
        self.n_min, self.n_max = n_min, n_max
        self.block_index = block_index
        self._contexts: dict[str, _ContextIndex] = {}

    def prepare(self, requests: list[Request], max_tokens: list[int]) -> None:
        pass  # each propose is a few dict lookups: nothing to batch

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Up to max_tokens draft tokens to follow the request's tokens; [] when no n-gram matched."""
        tokens = request.all_token_ids
        context = self._update(request.request_id, tokens)
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            suffix = tuple(tokens[-n:])
            end = context.ends.get(hash(suffix))
            if end is not None and tuple(tokens[end - n:end]) == suffix:
                return tokens[end:end + max_tokens]
            if self.block_index is not None and (draft := self.block_index.lookup(suffix, max_tokens)):
                return draft
        return []

    def forget(self, request_id: str) -> None:
        self._contexts.pop(request_id, None)

    def populate_kv(self) -> bool:
        return False  # no model, no pool

    def _update(self, request_id: str, tokens: list[int]) -> _ContextIndex:
        """Index the n-grams that end before the last token (the suffix itself must match an earlier one)."""
        context = self._contexts.setdefault(request_id, _ContextIndex())
        last = len(tokens) - 1
        for end in range(max(context.num_indexed, self.n_min), last + 1):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                context.ends[hash(tuple(tokens[end - n:end]))] = end
        context.num_indexed = max(context.num_indexed, last + 1)
        return context
