"""The two readers of serving/request_model.py without a server: the same request written as an HTTP body and as a
proto GenerateRequest becomes the same protocol.GenerateRequest for the replicas (test_serving_bad_input.py checks
that bad ones fail alike)."""

from __future__ import annotations

import json

import msgspec

from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.serving.grpc_api import generate_request
from cpuserve.serving.openai_api import ChatRequest, parse_body
from cpuserve.serving.protocol import GenerateRequest, ToolChoice
from cpuserve.v1 import inference_pb2 as pb

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": SCHEMA}}


def both(http: dict, grpc_fields: dict) -> tuple[GenerateRequest, GenerateRequest]:
    from_http = parse_body(json.dumps(http).encode(), ChatRequest).to_internal()
    _, from_grpc = generate_request(pb.GenerateRequest(**grpc_fields), 1 << 20)
    return from_http, from_grpc


def same(a: GenerateRequest, b: GenerateRequest) -> None:
    """Equal as the replica sees them, but for the names errors give (chat's top_logprobs is HTTP's own name)."""
    assert isinstance(a.sampling, SamplingParams)
    assert msgspec.structs.replace(a, rename={}) == msgspec.structs.replace(b, rename={})


def test_a_tool_call_request_reads_the_same_on_both_apis():
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "18 C"}, {"role": "user", "content": "And Rome?"}]
    http = {"messages": messages, "max_tokens": 8, "temperature": 0.5, "top_p": 0.5, "seed": 3, "stop": ["x"],
            "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": False}
    chat = pb.ChatMessages(messages=[
        pb.ChatMessage(role="user", content="Weather?"),
        pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c1", name="get_weather",
                                                                 arguments='{"city": "Oslo"}')]),
        pb.ChatMessage(role="tool", tool_call_id="c1", content="18 C"),
        pb.ChatMessage(role="user", content="And Rome?")])
    grpc = {"chat": chat, "sampling": pb.SamplingParameters(max_tokens=8, temperature=0.5, top_p=0.5, seed=3,
                                                            stop=["x"]),
            "tools": [pb.Tool(function=pb.FunctionDefinition(name="get_weather", description="Weather of a city",
                                                             parameters=json.dumps(SCHEMA)))],
            "tool_choice": pb.ToolChoice(function="get_weather"), "parallel_tool_calls": False}
    a, b = both(http, grpc)
    assert a.tool_choice == ToolChoice("get_weather") and a.parallel_tool_calls is False
    same(a, b)


def test_a_structured_request_reads_the_same_on_both_apis():
    http = {"messages": [{"role": "user", "content": "A city"}], "max_tokens": 16, "n": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}}
    grpc = {"chat": pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="A city")]), "n": 2,
            "sampling": pb.SamplingParameters(max_tokens=16),
            "structured_output": pb.StructuredOutput(json_schema=json.dumps(SCHEMA))}
    a, b = both(http, grpc)
    assert a.n == 2 and json.loads(a.sampling.structured_output.spec) == SCHEMA
    same(a, b)
