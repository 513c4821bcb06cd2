"""Turns a request's token stream into text deltas, applying stop strings without ever splitting UTF-8."""

from __future__ import annotations

from cpuserve.engine.detokenizer import IncrementalDetokenizer
from cpuserve.engine.tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        self.stop = stop
        # text that could still be the start of a stop string is held back until it is decided
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.num_emitted = 0

    def add(self, token_id: int, final: bool) -> tuple[str, bool]:
        """Returns (text delta, whether a stop string ended the text)."""
        self.text += self.detokenizer.add(token_id)
        if final:
            self.text += self.detokenizer.flush()
        if self.stop:
            start = max(0, self.num_emitted - self.holdback)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                return self._emit(len(self.text)), True
        end = len(self.text) if final else len(self.text) - self.holdback
        return self._emit(max(end, self.num_emitted)), False

    def _emit(self, end: int) -> str:
        delta = self.text[self.num_emitted: end]
        self.num_emitted = end
        return delta
