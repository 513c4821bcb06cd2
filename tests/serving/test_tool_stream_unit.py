"""Tool calls streamed incrementally (serving/tool_stream.py): every family's output fed in pieces of every size
gives the same content and calls as parsing the whole text (tools.parse_tool_calls), with each call announced once
(index, id, name) and its arguments' fragments concatenating to JSON equal to what the model wrote."""

from __future__ import annotations

import json

import pytest

from cpuserve.serving.protocol import Chunk
from cpuserve.serving.tool_stream import ToolCallStream
from cpuserve.serving.tools import HERMES, LLAMA3, MISTRAL, parse_tool_calls

ARGS = [{"city": "Paris {centre}", "unit": "C", "days": [1, 2], "note": "a \"quoted\" }"}, {}]
CALLS = {  # (model output, content before the calls)
    HERMES: ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(ARGS[0]) +
             '}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me check.\n"),
    LLAMA3: ('<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(ARGS[0]) +
             '}; {"name": "get_time", "parameters": {}}', ""),
    MISTRAL: ('[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + json.dumps(ARGS[0]) +
              '}, {"name": "get_time", "arguments": {}}]', ""),
}


def text_chunk(text: str, finish_reason: str | None = None) -> Chunk:
    return Chunk([], text, finish_reason, 1, 1)


def run(fmt: str, text: str, size: int, reason: str = "stop") -> tuple[str, list[dict], str]:
    """Feed text in pieces of `size` characters; (content, deltas, last finish_reason)."""
    stream = ToolCallStream(fmt)
    content, deltas, last = "", [], None
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for k, piece in enumerate(pieces):
        chunk, new = stream.apply(text_chunk(piece, reason if k == len(pieces) - 1 else None))
        content += chunk.text
        deltas += new
        last = chunk.finish_reason
    return content, deltas, last


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_calls_equal_the_parsed_ones(fmt, size):
    text, expected_content = CALLS[fmt]
    content, deltas, reason = run(fmt, text, size)
    whole_content, whole_calls = parse_tool_calls(fmt, text)
    assert content == expected_content and (content.strip() or None) == whole_content
    assert reason == "tool_calls"
    heads = [d for d in deltas if "id" in d]
    assert [(d["index"], d["function"]["name"]) for d in heads] == [(0, "get_weather"), (1, "get_time")]
    assert len({d["id"] for d in heads}) == 2 and all(d["type"] == "function" for d in heads)
    for index, call in enumerate(whole_calls):
        fragments = [d["function"]["arguments"] for d in deltas if d["index"] == index]
        assert json.loads("".join(fragments)) == ARGS[index] == json.loads(call["function"]["arguments"])
        first = next(i for i, d in enumerate(deltas) if d["index"] == index)
        assert "id" in deltas[first]  # the name comes before any argument fragment


def test_arguments_stream_before_the_call_is_complete():
    text, _ = CALLS[HERMES]
    cut = text.index('"days"')
    stream = ToolCallStream(HERMES)
    _, deltas = stream.apply(text_chunk(text[:cut]))
    sent = "".join(d["function"]["arguments"] for d in deltas)
    assert deltas[0]["function"]["name"] == "get_weather" and sent.startswith('{"city": "Paris {centre}"')


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL])
def test_text_without_calls_is_all_content(fmt):
    for text in ["The weather is fine.", "Use <tool_ tags", "ends with a half marker <tool_c", "  <|pyth",
                 "<tool_call>not a call</tool_call>", "[TOOL_CALLS] none", "{no name here}"]:
        for size in (1, 4, 100):
            content, deltas, reason = run(fmt, text, size)
            assert (content, deltas, reason) == (text, [], "stop")


def test_a_held_back_marker_prefix_is_not_sent_early():
    stream = ToolCallStream(HERMES)
    chunk, _ = stream.apply(text_chunk("Sure <tool_"))
    assert chunk.text == "Sure "
    chunk, deltas = stream.apply(text_chunk('call>\n{"name": "f", "arguments": {"a": 1}}'))
    assert chunk.text == "" and deltas[0]["function"]["name"] == "f"


def test_a_call_cut_by_max_tokens_ends_with_length():
    text, _ = CALLS[MISTRAL]
    content, deltas, reason = run(MISTRAL, text[:40], 5, reason="length")
    assert reason == "length" and deltas[0]["function"]["name"] == "get_weather"
