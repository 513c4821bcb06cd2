"""Streaming detokenization: token ids in, text deltas out, never half a character.

One token can carry part of a UTF-8 character (byte-level BPE splits emoji and CJK across tokens), and
some tokenizers change how a token reads depending on its left neighbour (SentencePiece's leading
space). So each step decodes a short window of recent ids twice, with and without the new ones, and
emits the difference; while the window ends in U+FFFD (an unfinished character) it emits nothing.

    ids:   ... | prefix_offset ........ read_offset ........ len(ids)
                 \\_ already emitted _/  \\_ not yet emitted _/
    delta = decode(ids[prefix_offset:]) - decode(ids[prefix_offset:read_offset])

Cost per token is O(window), not O(length of the output).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cpuserve.engine.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# ids of context kept from the prompt, enough for a leading-space decision (vLLM uses 5 too)
PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns generated ids into text deltas whose concatenation is the decoded output.

    Args:
        tokenizer: the model's Tokenizer.
        prompt_ids: the prompt, whose last few ids give left context to the first generated token.
        skip_special_tokens: drop special tokens (e.g. <|im_end|>) from the text.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids or [])[-PROMPT_CONTEXT:]
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one generated id; returns the text it completes (may be "" while a character is unfinished)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # nothing visible yet (special token skipped, or bytes of an unfinished character)
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Text still held back at the end of generation (an unfinished character decodes as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]
