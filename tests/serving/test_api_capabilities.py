"""What OpenAI-style clients send, through the real stack (Ray Serve, the official openai client, a grpcio client,
SmolLM2): structured outputs, tool calls, n samples.

Every output is checked with jsonschema / pydantic / re, independently of the engine's grammar library.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from pydantic import BaseModel, Field

from cpuserve.v1 import inference_pb2 as pb

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]},
                                                         "maxItems": 3}},
          "required": ["name", "age", "languages"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "order": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                               "total": {"type": "number", "minimum": 0, "maximum": 100}},
              "required": ["id", "total"], "additionalProperties": False},
    "status": {"enum": ["open", "paid", "shipped"]}}, "required": ["order", "status"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Give me a JSON record for a person."}]


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=50)


@pytest.fixture(scope="module")
def client(http_url):
    from openai import OpenAI

    return OpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("schema", [PERSON, ORDER], ids=["person", "nested order"])
def test_chat_json_schema_validates(client, schema):
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=80, temperature=0,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "record", "schema": schema, "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model="SmolLM2-135M-Instruct", max_tokens=80, temperature=0.7, seed=5,
                                      messages=[{"role": "user", "content": "Describe Paris."}], response_format=City)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and r.choices[0].finish_reason == "stop"
    assert City.model_validate_json(r.choices[0].message.content) == city


def test_streamed_json_object_and_length(client):
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=80, temperature=0,
                                            response_format={"type": "json_schema", "json_schema": {
                                                "name": "p", "schema": PERSON}}, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    # a budget too small for the schema: "length", and what came out is a prefix, not a finished document
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=5, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)


def test_completions_guided_regex_and_choice(client):
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The year was", max_tokens=8, temperature=0.9,
                                  seed=1, extra_body={"guided_regex": "(19|20)[0-9]{2}"})
    assert re.fullmatch(r"(19|20)[0-9]{2}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Is the sky green?", max_tokens=8,
                                  temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")


def test_grpc_structured_output(grpc_stub):
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=ASK[0]["content"])])
    r = grpc_stub.Complete(pb.GenerateRequest(chat=chat, sampling=pb.SamplingParameters(max_tokens=80, temperature=0),
                                              structured_output=pb.StructuredOutput(json_schema=json.dumps(ORDER))),
                           timeout=120)
    assert r.finish_reason == pb.FINISH_REASON_STOP
    jsonschema.validate(json.loads(r.text), ORDER)
    stream = grpc_stub.Generate(pb.GenerateRequest(
        text="Pick a colour:", sampling=pb.SamplingParameters(max_tokens=8, temperature=0),
        structured_output=pb.StructuredOutput(choice=pb.Choices(choices=["red", "green", "blue"]))), timeout=120)
    parts = list(stream)
    assert "".join(p.text for p in parts) in ("red", "green", "blue")
    assert parts[-1].finish_reason == pb.FINISH_REASON_STOP


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}}, "required": ["timezone"],
    "additionalProperties": False}}}


def test_tool_call_round_trip(client):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question, tools=[WEATHER, CLOCK],
                                       tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice.message
    call = choice.message.tool_calls[0]
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    # the call and its result go back into the conversation; "none": answer in words now
    follow = question + [choice.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "unit": "C"}'}]
    r2 = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=follow, tools=[WEATHER, CLOCK],
                                        tool_choice="none", max_tokens=24, temperature=0)
    assert r2.choices[0].message.tool_calls is None and r2.choices[0].message.content
    alone = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question, max_tokens=1)
    assert r2.usage.prompt_tokens > alone.usage.prompt_tokens + 25  # the call and its result were rendered


def test_named_tool_call_streams(client):
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False, max_tokens=80, temperature=0, stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert deltas[-1].finish_reason == "tool_calls"
    assert [(c.index, c.function.name) for c in calls if c.id] == [(0, "get_time")]  # announced once
    arguments = "".join(c.function.arguments or "" for c in calls)  # the fragments, in order
    jsonschema.validate(json.loads(arguments), CLOCK["function"]["parameters"])
    # incremental: the call's pieces came in several chunks, before the last one
    pieces = [i for i, d in enumerate(deltas) if d.delta.tool_calls]
    assert len(pieces) > 2 and pieces[0] < len(deltas) - 1


def _proto_tool(tool: dict) -> pb.Tool:
    f = tool["function"]
    return pb.Tool(function=pb.FunctionDefinition(name=f["name"], description=f.get("description", ""),
                                                  parameters=json.dumps(f["parameters"])))


def test_grpc_tool_call_round_trip(grpc_stub):
    question = pb.ChatMessage(role="user", content="What is the weather in Paris?")
    tools = [_proto_tool(WEATHER), _proto_tool(CLOCK)]
    sampling = pb.SamplingParameters(max_tokens=80, temperature=0)
    r = grpc_stub.Complete(pb.GenerateRequest(chat=pb.ChatMessages(messages=[question]), tools=tools,
                                              tool_choice=pb.ToolChoice(mode="required"), parallel_tool_calls=False,
                                              sampling=sampling), timeout=120)
    assert r.finish_reason == pb.FINISH_REASON_TOOL_CALLS and len(r.tool_calls) == 1, r
    call = r.tool_calls[0]
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.name]
    jsonschema.validate(json.loads(call.arguments), tool["function"]["parameters"])
    assert call.id and "<tool_call>" not in r.text
    # the call and its result go back into the conversation; "none": answer in words now
    follow = [question, pb.ChatMessage(role="assistant", tool_calls=[call]),
              pb.ChatMessage(role="tool", tool_call_id=call.id, content='{"temperature": 18, "unit": "C"}')]
    r2 = grpc_stub.Complete(pb.GenerateRequest(chat=pb.ChatMessages(messages=follow), tools=tools,
                                               tool_choice=pb.ToolChoice(mode="none"),
                                               sampling=pb.SamplingParameters(max_tokens=24, temperature=0)),
                            timeout=120)
    assert not r2.tool_calls and r2.text and r2.finish_reason != pb.FINISH_REASON_TOOL_CALLS
    alone = grpc_stub.Complete(pb.GenerateRequest(chat=pb.ChatMessages(messages=[question]),
                                                  sampling=pb.SamplingParameters(max_tokens=1)), timeout=120)
    assert r2.usage.prompt_tokens > alone.usage.prompt_tokens + 25  # the call and its result were rendered


def test_grpc_named_tool_call_streams(grpc_stub):
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="What time is it in Tokyo?")])
    parts = list(grpc_stub.Generate(pb.GenerateRequest(
        chat=chat, tools=[_proto_tool(WEATHER), _proto_tool(CLOCK)], tool_choice=pb.ToolChoice(function="get_time"),
        sampling=pb.SamplingParameters(max_tokens=80, temperature=0.8, seed=4)), timeout=120))
    assert parts[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS
    pieces = [c for p in parts for c in p.tool_calls]
    heads = [c for c in pieces if c.id]
    assert heads and {c.name for c in heads} == {"get_time"}  # parallel calls allowed: each is get_time
    assert [c.index for c in heads] == list(range(len(heads)))
    for head in heads:  # each call's argument fragments, in order, make its arguments
        arguments = "".join(c.arguments for c in pieces if c.index == head.index)
        jsonschema.validate(json.loads(arguments), CLOCK["function"]["parameters"])
    assert sum(bool(p.tool_calls) for p in parts) > 2  # in pieces, as the model wrote them


def test_completions_echo(client, grpc_stub):
    prompt = "The capital of France is"
    plain = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=6, temperature=0)
    echoed = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=6, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=6, temperature=0,
                                       echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == echoed.choices[0].text
    # a prompt of token ids comes back as the text they encode, for each of n samples
    ids = list(grpc_stub.Tokenize(pb.TokenizeRequest(text=prompt), timeout=60).token_ids)
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=3, temperature=1.0, n=2,
                                  seed=2, echo=True)
    assert [c.text.startswith(prompt) for c in r.choices] == [True, True]


def test_n_samples_share_the_prompt_blocks(client):
    long_prompt = "Here is a list of CPU cache facts. " * 12  # several KV blocks
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=long_prompt, n=3, max_tokens=6,
                                  temperature=1.0, seed=11)
    assert sorted(c.index for c in r.choices) == [0, 1, 2] and all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 18
    # samples 1 and 2 found the prompt's full blocks in the prefix cache that sample 0 filled
    assert r.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens
    assert len({c.text for c in r.choices}) > 1  # seeds 11, 12, 13: different samples
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, n=2, max_tokens=5,
                                            temperature=1.0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    finished = [ch.index for c in chunks for ch in c.choices if ch.finish_reason]
    assert sorted(finished) == [0, 1] and all(texts.values())
    assert chunks[-1].usage.completion_tokens == 10


def test_grpc_n_samples(grpc_stub):
    sampling = pb.SamplingParameters(max_tokens=4, temperature=1.0, seed=3)
    r = grpc_stub.Complete(pb.GenerateRequest(text="A CPU cache is", sampling=sampling, n=3), timeout=120)
    assert [s.index for s in r.samples] == [0, 1, 2] and all(len(s.token_ids) == 4 for s in r.samples)
    assert r.text == r.samples[0].text and r.usage.completion_tokens == 12
    parts = list(grpc_stub.Generate(pb.GenerateRequest(text="A CPU cache is", sampling=sampling, n=2), timeout=120))
    ends = {p.index: p.finish_reason for p in parts if p.finish_reason}
    assert ends == {0: pb.FINISH_REASON_LENGTH, 1: pb.FINISH_REASON_LENGTH}
    assert sum(len(p.token_ids) for p in parts) == 8
