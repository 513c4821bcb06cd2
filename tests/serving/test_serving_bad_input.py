"""Bad input through the real stack: each case gets INVALID_ARGUMENT / NOT_FOUND or HTTP 400/404 (413 for an
oversized body) with an error naming the field, and the server then still serves a valid request."""

from __future__ import annotations

import grpc
import httpx
import pytest

from cpuserve.v1 import inference_pb2 as pb

pytestmark = pytest.mark.slow

# a short context so "prompt over the context" is cheap; a small body limit so "oversized" is too
SERVE_CONFIG = dict(max_model_len=256, max_request_bytes=65536)
LONG_TEXT = "word " * 400  # ~400 tokens > 256
OK_COMPLETION = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

HTTP_CASES = [  # (id, path, body: dict | raw bytes, status, param)
    ("empty prompt", "completions", {"prompt": ""}, 400, "prompt"),
    ("empty token ids", "completions", {"prompt": []}, 400, "prompt"),
    ("token id out of range", "completions", {"prompt": [1, 10_000_000]}, 400, "prompt"),
    ("prompt over the context", "completions", {"prompt": LONG_TEXT}, 400, "prompt"),
    ("chat over the context", "chat/completions", {"messages": [{"role": "user", "content": LONG_TEXT}]}, 400,
     "messages"),
    ("unknown model", "completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("unknown model (chat)", "chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]},
     404, "model"),
    ("temperature < 0", "completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("top_p = 0", "completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_p > 1", "completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("top_k < 0", "completions", {"prompt": "hi", "top_k": -1}, 400, "top_k"),
    ("min_p > 1", "completions", {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("max_tokens = 0", "completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("presence_penalty > 2", "completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("repetition_penalty = 0", "completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("frequency_penalty > 2", "completions", {"prompt": "hi", "frequency_penalty": 3}, 400, "frequency_penalty"),
    ("logit_bias key not a token id", "completions", {"prompt": "hi", "logit_bias": {"hello": 5}}, 400, "logit_bias"),
    ("logit_bias over 100", "completions", {"prompt": "hi", "logit_bias": {"42": 500}}, 400, "logit_bias"),
    ("logit_bias token out of range", "completions", {"prompt": "hi", "logit_bias": {"10000000": 5}}, 400,
     "logit_bias"),
    # fields that would change the result and are not implemented: refused, never ignored
    ("tools on completions", "completions", {"prompt": "hi", "tools": [TOOL]}, 400, "tools"),
    # tool calling: bad definitions and choices name the field
    ("tool parameters not a schema", "chat/completions", {**CHAT, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, 400,
     "tools.0.function.parameters"),
    ("tool name with spaces", "chat/completions", {**CHAT, "tools": [
        {"type": "function", "function": {"name": "get weather"}}]}, 400, "tools.0.function.name"),
    ("tool name twice", "chat/completions", {**CHAT, "tools": [TOOL, TOOL]}, 400, "tools.1.function.name"),
    ("tool calls on a user message", "chat/completions", {"messages": [
        {"role": "user", "content": "hi", "tool_calls": [{"id": "c1", "type": "function",
                                                          "function": {"name": "f", "arguments": "{}"}}]}]}, 400,
     "messages.0.tool_calls"),
    ("tool_choice without tools", "chat/completions", {**CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ("tool_choice unknown function", "chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "other"}}}, 400, "tool_choice"),
    ("tool_choice unknown value", "chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": "always"}, 400,
     "tool_choice"),
    ("tool_choice without a function", "chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": {
        "type": "function"}}, 400, "tool_choice"),
    ("tool_choice not a string or object", "chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": 5}, 400,
     "tool_choice"),
    ("tool_choice with response_format", "chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": "required",
                                                              "response_format": {"type": "json_object"}}, 400,
     "tool_choice"),
    ("tool call arguments not JSON", "chat/completions", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": "{oops"}}]}]}, 400,
     "messages.1.tool_calls"),
    ("user message without content", "chat/completions", {"messages": [{"role": "user"}]}, 400, "messages.0.content"),
    ("suffix", "completions", {"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ("an unknown field", "completions", {"prompt": "hi", "frobnicate": True}, 400, "frobnicate"),
    ("logprobs > 20", "completions", {"prompt": "hi", "logprobs": 30}, 400, "logprobs"),
    ("top_logprobs > 20", "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                               "top_logprobs": 30}, 400, "top_logprobs"),
    ("n = 0", "completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("n = 17", "completions", {"prompt": "hi", "n": 17}, 400, "n"),
    ("n > 1 with tools", "chat/completions", {**CHAT, "n": 2, "tools": [TOOL]}, 400, "n"),
    ("echo with logprobs", "completions", {"prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo"),
    ("echo on chat", "chat/completions", {**CHAT, "echo": True}, 400, "echo"),
    ("empty stop string", "completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("negative stop token", "completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("malformed JSON", "completions", b'{"prompt": "hi",', 400, "body"),
    ("JSON not an object", "completions", b'["hi"]', 400, "body"),
    ("wrong type: temperature", "completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("wrong type: max_tokens", "completions", {"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens"),
    ("wrong type: stream", "completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("wrong type: prompt", "completions", {"prompt": 5}, 400, "prompt"),
    ("wrong type: messages", "chat/completions", {"messages": "hi"}, 400, "messages"),
    ("wrong type: content", "chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages.0.content"),
    ("unknown role", "chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    ("missing prompt", "completions", {"max_tokens": 4}, 400, "prompt"),
    ("missing messages", "chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("empty messages", "chat/completions", {"messages": []}, 400, "messages"),
    ("invalid UTF-8", "completions", b'{"prompt": "caf\xe9"}', 400, "body"),
    ("oversized body", "completions", {"prompt": "x" * 70_000}, 413, "body"),
    # found by tests/serving/fuzz: JSON that Python's parser takes but the standard does not, and values past what
    # the engine's types hold
    ("nested past the parser's recursion", "completions", b'{"prompt": "hi", "metadata": ' + b"[" * 5000 +
     b"]" * 5000 + b"}", 400, "body"),
    ("nested past the limit", "completions", b'{"prompt": "hi", "metadata": ' + b"[" * 100 + b"]" * 100 + b"}", 400,
     "metadata"),
    ("5000-digit integer", "completions", b'{"prompt": "hi", "seed": ' + b"1" * 5000 + b"}", 400, "body"),
    ("NaN", "completions", b'{"prompt": "hi", "temperature": NaN}', 400, "body"),
    ("number past a double", "completions", b'{"prompt": "hi", "temperature": 1e400}', 400, "body"),
    ("lone surrogate in the prompt", "completions", b'{"prompt": "a\\ud800"}', 400, "prompt"),
    ("lone surrogate in a message", "chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     "messages.0.content"),
    ("lone surrogate in a field name", "completions", b'{"prompt": "hi", "\\ud800": 1}', 400, "body"),
    ("seed past 64 bits", "completions", {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ("integer past 64 bits in a JSON schema", "completions", {"prompt": "hi", "guided_json": {
        "type": "integer", "maximum": 2**70}}, 400, "guided_json"),
    ("empty field name", "completions", {"prompt": "hi", "": 1}, 400, ""),
    ("logit_bias key a superscript digit", "completions", {"prompt": "hi", "logit_bias": {"\u00b2": 1}}, 400,
     "logit_bias"),
    ("logit_bias key an Arabic-Indic digit", "completions", {"prompt": "hi", "logit_bias": {"\u0663": 1}}, 400,
     "logit_bias"),
    # structured outputs: a spec that cannot compile names the field that carried it
    ("bad JSON schema", "chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}}, 400, "response_format"),
    ("unsatisfiable JSON schema", "chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "minLength": 5, "maxLength": 2}}}}, 400, "response_format"),
    ("json_schema without a schema", "chat/completions", {**CHAT, "response_format": {"type": "json_schema",
                                                                                      "json_schema": {"name": "x"}}},
     400, "response_format"),
    ("unknown response_format type", "chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400,
     "response_format.type"),
    ("bad guided_json", "completions", {"prompt": "hi", "guided_json": {"$ref": "#/$defs/missing"}}, 400, "guided_json"),
    ("bad guided_regex", "completions", {"prompt": "hi", "guided_regex": "("}, 400, "guided_regex"),
    ("bad guided_grammar", "completions", {"prompt": "hi", "guided_grammar": "start: undefined_rule"}, 400,
     "guided_grammar"),
    ("empty guided_choice", "completions", {"prompt": "hi", "guided_choice": []}, 400, "guided_choice"),
    ("two structured forms", "chat/completions", {**CHAT, "response_format": {"type": "json_object"},
                                                  "guided_regex": "[0-9]+"}, 400, "guided_regex"),
]


def _assert_still_serves(http_url: str) -> None:
    r = httpx.post(f"{http_url}/v1/completions", json=OK_COMPLETION, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path,body,status,param", [c[1:] for c in HTTP_CASES], ids=[c[0] for c in HTTP_CASES])
def test_http_bad_input(http_url, path, body, status, param):
    url = f"{http_url}/v1/{path}"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    else:
        r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    _assert_still_serves(http_url)


def test_fields_that_cannot_change_the_output_are_accepted(http_url):
    body = {**OK_COMPLETION, "user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}
    r = httpx.post(f"{http_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_http_stream_bad_input_is_an_error_status_not_a_stream(http_url):
    r = httpx.post(f"{http_url}/v1/completions", json={"prompt": "", "stream": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_http_unknown_path_and_method(http_url):
    r = httpx.get(f"{http_url}/v1/nothing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(f"{http_url}/v1/completions", timeout=10)
    assert r.status_code == 405 and "error" in r.json()
    _assert_still_serves(http_url)


def _text(text: str, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParameters(**sampling))


def _structured(**kind) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(max_tokens=4),
                              structured_output=pb.StructuredOutput(**kind))


def _chat(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]),
                              sampling=pb.SamplingParameters(max_tokens=4), **fields)


def _tool(name: str, parameters: str = "") -> pb.Tool:
    return pb.Tool(function=pb.FunctionDefinition(name=name, parameters=parameters))


GRPC_CASES = [  # (id, request: message | raw bytes, code, field named in the details)
    ("empty prompt", _text(""), "INVALID_ARGUMENT", "prompt"),
    ("no prompt", pb.GenerateRequest(), "INVALID_ARGUMENT", "prompt"),
    ("empty token ids", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "INVALID_ARGUMENT", "prompt"),
    ("token id out of range", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[10_000_000])), "INVALID_ARGUMENT",
     "prompt"),
    ("prompt over the context", _text(LONG_TEXT), "INVALID_ARGUMENT", "prompt"),
    ("unknown model", pb.GenerateRequest(model="gpt-9", text="hi"), "NOT_FOUND", "model"),
    ("temperature < 0", _text("hi", temperature=-1), "INVALID_ARGUMENT", "temperature"),
    ("top_p = 0", _text("hi", top_p=0), "INVALID_ARGUMENT", "top_p"),
    ("top_p > 1", _text("hi", top_p=1.5), "INVALID_ARGUMENT", "top_p"),
    ("min_p > 1", _text("hi", min_p=2), "INVALID_ARGUMENT", "min_p"),
    ("max_tokens = 0", _text("hi", max_tokens=0), "INVALID_ARGUMENT", "max_tokens"),
    ("presence_penalty < -2", _text("hi", presence_penalty=-3), "INVALID_ARGUMENT", "presence_penalty"),
    ("repetition_penalty = 0", _text("hi", repetition_penalty=0), "INVALID_ARGUMENT", "repetition_penalty"),
    ("logprobs > 20", _text("hi", logprobs=30), "INVALID_ARGUMENT", "logprobs"),
    ("frequency_penalty > 2", _text("hi", frequency_penalty=3), "INVALID_ARGUMENT", "frequency_penalty"),
    ("logit_bias over 100", _text("hi", logit_bias={42: 500}), "INVALID_ARGUMENT", "logit_bias"),
    ("logit_bias token out of range", _text("hi", logit_bias={10_000_000: 1}), "INVALID_ARGUMENT", "logit_bias"),
    ("empty stop string", _text("hi", stop=[""]), "INVALID_ARGUMENT", "stop"),
    ("temperature infinite", _text("hi", temperature=float("inf")), "INVALID_ARGUMENT", "temperature"),
    ("repetition_penalty infinite", _text("hi", repetition_penalty=float("inf")), "INVALID_ARGUMENT",
     "repetition_penalty"),
    ("no chat messages", pb.GenerateRequest(chat=pb.ChatMessages()), "INVALID_ARGUMENT", "chat.messages"),
    ("unknown role", pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="robot", content="x")])),
     "INVALID_ARGUMENT", "role"),
    ("invalid UTF-8 in text", _text("abc").SerializeToString().replace(b"abc", b"a\xffc"), "INVALID_ARGUMENT", "text"),
    ("invalid UTF-8 in chat content",
     pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="abc")]))
     .SerializeToString().replace(b"abc", b"a\xffc"), "INVALID_ARGUMENT", "chat.messages.content"),
    ("invalid UTF-8 in stop", _text("hi", stop=["abc"]).SerializeToString().replace(b"abc", b"a\xffc"),
     "INVALID_ARGUMENT", "sampling.stop"),
    ("not a protobuf message", b"\xff\xff\xff\xff", "INVALID_ARGUMENT", "request"),
    ("oversized prompt", _text("x" * 70_000), "INVALID_ARGUMENT", "text"),
    ("n = 17", pb.GenerateRequest(text="hi", n=17), "INVALID_ARGUMENT", "n"),
    ("bad JSON schema", _structured(json_schema='{"type": "foo"}'), "INVALID_ARGUMENT",
     "structured_output.json_schema"),
    ("JSON schema not JSON", _structured(json_schema="{type"), "INVALID_ARGUMENT", "structured_output.json_schema"),
    ("bad regex", _structured(regex="("), "INVALID_ARGUMENT", "structured_output.regex"),
    ("bad grammar", _structured(grammar="root ::= undefined"), "INVALID_ARGUMENT", "structured_output.grammar"),
    ("empty choice", _structured(choice=pb.Choices()), "INVALID_ARGUMENT", "structured_output.choice"),
    ("json_object false", _structured(json_object=False), "INVALID_ARGUMENT", "structured_output.json_object"),
    ("empty structured_output", _structured(), "INVALID_ARGUMENT", "structured_output"),
    ("invalid UTF-8 in regex", _structured(regex="abc").SerializeToString().replace(b"abc", b"a\xffc"),
     "INVALID_ARGUMENT", "structured_output.regex"),
    # tool calling
    ("tool parameters not JSON", _chat(tools=[_tool("f", "{type")]), "INVALID_ARGUMENT", "tools.0.function.parameters"),
    ("tool parameters not an object", _chat(tools=[_tool("f", "[1]")]), "INVALID_ARGUMENT",
     "tools.0.function.parameters"),
    ("empty tool name", _chat(tools=[_tool("")]), "INVALID_ARGUMENT", "tools.0.function.name"),
    ("tools with a text prompt", pb.GenerateRequest(text="hi", tools=[_tool("f")]), "INVALID_ARGUMENT", "tools"),
    ("empty tool_choice", _chat(tools=[_tool("f")], tool_choice=pb.ToolChoice()), "INVALID_ARGUMENT", "tool_choice"),
    ("invalid UTF-8 in a tool name", _chat(tools=[_tool("abc")]).SerializeToString().replace(b"abc", b"a\xffc"),
     "INVALID_ARGUMENT", "tools.function.name"),
]


@pytest.fixture(scope="module")
def raw_rpcs(serving):
    """Generate and Complete taking raw request bytes, to send what a protobuf library would refuse to build."""
    channel = grpc.insecure_channel(f"127.0.0.1:{serving.grpc_port}")
    yield (channel.unary_stream("/cpuserve.v1.Inference/Generate", request_serializer=None,
                                response_deserializer=pb.GenerateResponse.FromString),
           channel.unary_unary("/cpuserve.v1.Inference/Complete", request_serializer=None,
                               response_deserializer=pb.CompleteResponse.FromString))
    channel.close()


@pytest.mark.parametrize("request_,code,field", [c[1:] for c in GRPC_CASES], ids=[c[0] for c in GRPC_CASES])
def test_grpc_bad_input(grpc_stub, raw_rpcs, request_, code, field):
    raw = request_ if isinstance(request_, bytes) else request_.SerializeToString()
    generate, complete = raw_rpcs
    for call in (lambda: list(generate(raw, timeout=60)), lambda: complete(raw, timeout=60)):
        with pytest.raises(grpc.RpcError) as info:  # the streaming and the unary rpc validate alike
            call()
        assert info.value.code() == getattr(grpc.StatusCode, code), info.value.details()
        assert field in info.value.details()
    ok = grpc_stub.Complete(_text("Hello", max_tokens=2, temperature=0), timeout=60)
    assert ok.usage.completion_tokens == 2


def test_grpc_message_over_grpc_limit_then_serves(grpc_stub):
    """grpc itself refuses a message over its 4 MiB receive limit, before the app; the server lives on."""
    with pytest.raises(grpc.RpcError) as info:
        list(grpc_stub.Generate(_text("x" * (5 << 20)), timeout=60))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert grpc_stub.Complete(_text("Hello", max_tokens=2, temperature=0), timeout=60).usage.completion_tokens == 2


def test_grpc_bytes_that_are_no_message(serving, grpc_stub):
    """Every rpc parses its request: ListModels and Health answered OK to any bytes before (found by fuzzing)."""
    channel = grpc.insecure_channel(f"127.0.0.1:{serving.grpc_port}")
    for name in ("Tokenize", "ListModels", "Health"):
        rpc = channel.unary_unary(f"/cpuserve.v1.Inference/{name}", request_serializer=None,
                                  response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            rpc(b"\xff\xff\xff\xff", timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request" in info.value.details(), name
    channel.close()
    assert grpc_stub.Complete(_text("Hello", max_tokens=2, temperature=0), timeout=60).usage.completion_tokens == 2


def test_grpc_tokenize_unknown_model(grpc_stub):
    with pytest.raises(grpc.RpcError) as info:
        grpc_stub.Tokenize(pb.TokenizeRequest(model="gpt-9", text="hi"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "model" in info.value.details()


# The same bad values over both APIs: both go through one request model (serving/request_model.py), so both must
# refuse with the same field and the same message. (id, HTTP chat fields, gRPC GenerateRequest fields, field)
BAD_TOOLS = [{"type": "function", "function": {"name": "get weather"}}]
SAME_CASES = [
    ("temperature", {"temperature": -1}, {"sampling": pb.SamplingParameters(temperature=-1)}, "temperature"),
    ("top_p", {"top_p": 1.5}, {"sampling": pb.SamplingParameters(top_p=1.5)}, "top_p"),
    ("max_tokens", {"max_tokens": 0}, {"sampling": pb.SamplingParameters(max_tokens=0)}, "max_tokens"),
    ("stop", {"stop": [""]}, {"sampling": pb.SamplingParameters(stop=[""])}, "stop"),
    ("logit_bias", {"logit_bias": {"42": 500}}, {"sampling": pb.SamplingParameters(logit_bias={42: 500})},
     "logit_bias"),
    ("n", {"n": 17}, {"n": 17}, "n"),
    ("tool name", {"tools": BAD_TOOLS}, {"tools": [_tool("get weather")]}, "tools.0.function.name"),
    ("tool name twice", {"tools": [TOOL, TOOL]}, {"tools": [_tool("f"), _tool("f")]}, "tools.1.function.name"),
    ("tool parameters", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     {"tools": [_tool("f", '{"type": "nope"}')]}, "tools.0.function.parameters"),
    ("tool_choice value", {"tools": [TOOL], "tool_choice": "always"},
     {"tools": [_tool("f")], "tool_choice": pb.ToolChoice(mode="always")}, "tool_choice"),
    ("tool_choice function", {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     {"tools": [_tool("f")], "tool_choice": pb.ToolChoice(function="g")}, "tool_choice"),
    ("tool_choice without tools", {"tool_choice": "required"}, {"tool_choice": pb.ToolChoice(mode="required")},
     "tool_choice"),
    ("n with tools", {"tools": [TOOL], "n": 2}, {"tools": [_tool("f")], "n": 2}, "n"),
]


@pytest.mark.parametrize("http_fields,grpc_fields,field", [c[1:] for c in SAME_CASES], ids=[c[0] for c in SAME_CASES])
def test_both_apis_refuse_alike(http_url, grpc_stub, http_fields, grpc_fields, field):
    r = httpx.post(f"{http_url}/v1/chat/completions", json={**CHAT, **http_fields}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(field)
    request = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]),
                                 **{"sampling": pb.SamplingParameters(max_tokens=4), **grpc_fields})
    with pytest.raises(grpc.RpcError) as info:
        grpc_stub.Complete(request, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == error["message"]
    _assert_still_serves(http_url)
