"""Tool-call formats without a server: parsing each family's output, the grammars that enforce a call (checked by
llguidance on SmolLM2's tokenizer, the calls they accept checked with jsonschema), and the prompts."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cpuserve.engine.grammar import GrammarCompiler, StructuredOutput
from cpuserve.serving.tools import (HERMES, LLAMA3, MISTRAL, format_of, parse_tool_calls, prepare_messages,
                                    tool_grammar)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("fmt,text,content", [
    (HERMES, 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Sure."),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}', None),
    (LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
             '{"name": "get_time", "parameters": {}}', None),
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "get_time", "arguments": {}}]', None),
])
def test_each_family_parses_into_openai_tool_calls(fmt, text, content):
    got_content, calls = parse_tool_calls(fmt, text)
    assert got_content == content
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL])
def test_text_that_is_not_a_call_stays_content(fmt):
    for text in ["The weather is fine.", "{not json", '<tool_call>{"city": 1}</tool_call>']:
        assert parse_tool_calls(fmt, text) == (text, [])


def test_formats_come_from_the_template():
    assert format_of(None) == HERMES and format_of("{{ '<tool_call>' }}") == HERMES
    assert format_of("{{ '[TOOL_CALLS]' }}") == MISTRAL and format_of("Environment: ipython") == LLAMA3


@pytest.fixture(scope="module")
def compiler():
    from cpuserve.engine.loader import load_checkpoint

    tok = load_checkpoint(None, show_progress=False).tokenizer
    return tok, GrammarCompiler(tok.backend.to_str(), tok.vocab_size, tok.eos_token_ids)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL])
def test_a_required_call_grammar_accepts_valid_calls_and_refuses_others(compiler, fmt):
    tok, grammars = compiler
    spec = tool_grammar(fmt, [WEATHER, TIME], only="get_weather", parallel=False)
    good = {"name": "get_weather", ("parameters" if fmt == LLAMA3 else "arguments"): {"city": "Oslo", "unit": "C"}}
    jsonschema.validate(list(good.values())[1], WEATHER["function"]["parameters"])
    wrap = {HERMES: "<tool_call>\n{}\n</tool_call>", LLAMA3: "{}", MISTRAL: "[TOOL_CALLS][{}]"}[fmt]
    for call, ok in [(good, True), ({**good, "name": "get_time"}, False),
                     ({"name": "get_weather", list(good)[1]: {"town": "Oslo"}}, False)]:
        text = wrap.replace("{}", json.dumps(call))
        matcher = grammars.matcher(StructuredOutput("grammar", spec))
        accepted = all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False))
        assert (accepted and matcher.is_accepting()) == ok, (text, matcher.get_error())


def test_a_template_without_tools_gets_them_in_a_system_message():
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
    out = prepare_messages(messages, [WEATHER], knows_tools=False)
    assert out[0]["role"] == "system" and json.dumps(WEATHER) in out[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in out[2]["content"]
    assert out[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}
    kept = prepare_messages(messages, [WEATHER], knows_tools=True)  # the template renders them itself
    assert kept[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"} and kept[2]["role"] == "tool"
