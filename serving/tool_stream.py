"""Tool calls streamed as the model writes them (OpenAI's delta.tool_calls), for the formats of tools.py.

    stream = ToolCallStream(fmt)
    chunk, deltas = stream.apply(chunk)   per streamed chunk: its text becomes the content written before the
                                          calls; deltas are [{"index", "id", "type", "function": {"name",
                                          "arguments": ""}}] when a call's name is known, then
                                          [{"index", "function": {"arguments": fragment}}] as its arguments grow

The concatenated fragments of a call are its arguments' JSON text as the model wrote it. Text that may still
turn into a call marker ("<tool_" ...) is held back until it cannot. A call, once announced, cannot be taken
back: with tool_choice "auto" a model that starts a call and then writes something else leaves a call whose
arguments do not parse (required / named calls are grammar-enforced and always parse).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec

from cpuserve.serving.protocol import Chunk
from cpuserve.serving.tools import HERMES, LLAMA3, MISTRAL

_MARKER = {HERMES: "<tool_call>", MISTRAL: "[TOOL_CALLS]"}
_ARG_KEYS = ("arguments", "parameters")


class _Call:
    __slots__ = ("name", "args_start", "args_end", "num_sent", "announced")

    def __init__(self) -> None:
        self.name: str | None = None
        self.args_start: int | None = None  # where the arguments' JSON value starts in the text
        self.args_end: int | None = None  # where it ends, once complete
        self.num_sent = 0  # characters of the arguments already sent
        self.announced = False


class ToolCallStream:
    """Incremental parser of one streamed answer; see the module docstring."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.text = ""
        self.region: int | None = None  # where the calls start in the text, once known
        self.num_content_sent = 0
        self.calls: list[_Call] = []
        # JSON scanner state over text[region:]: brace depth, strings, the current key / value at depth 1
        self._pos = 0
        self._depth = 0
        self._in_string = self._escape = False
        self._string_start = 0
        self._last_string: tuple[int, int] | None = None  # (start, end) of the last string closed at depth 1
        self._key: str | None = None  # a key at depth 1 whose value comes next
        self._value_key: str | None = None  # the key whose value is being read at depth 1
        self._value_start = 0

    def apply(self, chunk: Chunk) -> tuple[Chunk, list[dict[str, Any]]]:
        """One streamed chunk -> (the chunk with its text replaced by the new content, new tool-call deltas)."""
        self.text += chunk.text
        final = chunk.finish_reason is not None
        self._find_region(final)
        content_end = len(self.text) if self.region is None else self.region
        if self.region is None and not final:
            content_end -= _held_back(self.text, self.fmt)
        content = self.text[self.num_content_sent:content_end]
        self.num_content_sent = max(self.num_content_sent, content_end)
        deltas = self._scan() if self.region is not None else []
        if final and self.region is not None and not any(c.announced for c in self.calls):
            content += self.text[self.num_content_sent:]  # a marker but no call after it: it was all text
            self.num_content_sent = len(self.text)
        reason = chunk.finish_reason
        if final and any(c.announced for c in self.calls) and reason == "stop":
            reason = "tool_calls"
        return msgspec.structs.replace(chunk, text=content, finish_reason=reason), deltas

    def _find_region(self, final: bool) -> None:
        if self.region is not None:
            return
        if self.fmt == LLAMA3:  # a call is the whole answer: JSON, optionally after <|python_tag|>
            body = self.text.lstrip()
            if body.startswith("{") or body.startswith("<|python_tag|>"):
                self.region = len(self.text) - len(body)
            return
        at = self.text.find(_MARKER[self.fmt])
        if at >= 0:
            self.region = at
            self._pos = at + len(_MARKER[self.fmt])

    def _scan(self) -> list[dict[str, Any]]:
        text = self.text
        if self._pos < self.region:
            self._pos = self.region
        while self._pos < len(text):
            self._step(text[self._pos], self._pos)
            self._pos += 1
        return self._deltas()

    def _step(self, ch: str, pos: int) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                if self._depth == 1:
                    self._last_string = (self._string_start, pos + 1)
                    if self._value_key == "name":
                        self.calls[-1].name = _loads(self.text[self._string_start:pos + 1])
                        self._value_key = None
            return
        if self._depth == 0:  # between calls: tags, separators, brackets
            if ch == "{":
                self.calls.append(_Call())
                self._depth, self._key, self._value_key, self._last_string = 1, None, None, None
            return
        if ch == '"':
            self._in_string, self._string_start = True, pos
            if self._depth == 1 and self._key is not None:
                self._start_value(pos)
        elif ch == ":" and self._depth == 1 and self._last_string is not None:
            self._key = _loads(self.text[self._last_string[0]:self._last_string[1]])
        elif ch in "{[":
            if self._depth == 1 and self._key is not None:
                self._start_value(pos)
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 1 and self._value_key in _ARG_KEYS:
                self.calls[-1].args_end = pos + 1
                self._value_key = None
            elif self._depth == 0:
                self._end_scalar(pos)
        elif ch == "," and self._depth == 1:
            self._end_scalar(pos)
            self._last_string = None
        elif not ch.isspace() and self._depth == 1 and self._key is not None:
            self._start_value(pos)  # a number, true, false or null

    def _start_value(self, pos: int) -> None:
        self._value_key, self._key = self._key, None
        if self._value_key in _ARG_KEYS:
            self.calls[-1].args_start = pos

    def _end_scalar(self, pos: int) -> None:
        """A value at depth 1 that is not an object or array ends at the next , or }."""
        call = self.calls[-1] if self.calls else None
        if call is not None and self._value_key in _ARG_KEYS and call.args_end is None:
            call.args_end = len(self.text[:pos].rstrip())
        self._value_key = None

    def _deltas(self) -> list[dict[str, Any]]:
        deltas = []
        for index, call in enumerate(self.calls):
            if call.name is None:
                continue
            if not call.announced:
                call.announced = True
                deltas.append({"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            if call.args_start is None:
                continue
            end = call.args_end if call.args_end is not None else len(self.text)
            fragment = self.text[call.args_start + call.num_sent:end]
            if fragment:
                call.num_sent += len(fragment)
                deltas.append({"index": index, "function": {"arguments": fragment}})
        return deltas


def _held_back(text: str, fmt: str) -> int:
    """How many characters at the end of text may still become the start of a call."""
    if fmt == LLAMA3:
        body = text.lstrip()
        return len(text) if not body or "<|python_tag|>".startswith(body) else 0
    marker = _MARKER[fmt]
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
