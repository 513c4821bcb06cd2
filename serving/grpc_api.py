"""gRPC side of the ingress: servicer registration for Ray Serve's proxy, request parsing, response building.

The proxy normally parses requests with the generated deserializer, and a string field holding invalid
UTF-8 then fails inside grpc as INTERNAL. We register the service with raw-bytes requests instead, so the
ingress parses them itself and answers INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import msgspec
from google.protobuf.message import DecodeError

from cpuserve.serving.protocol import DEFAULT_MAX_TOKENS, Chunk, GenerateRequest, RequestError, Usage, total
from cpuserve.serving.request_model import ApiRequest, to_internal
from cpuserve.serving.tools import parse_tool_calls
from cpuserve.v1 import inference_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["Inference"]
FINISH_REASONS = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP,
                  "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT,
                  "tool_calls": pb.FINISH_REASON_TOOL_CALLS}
_OPTIONAL_SAMPLING = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                      "presence_penalty", "frequency_penalty", "seed", "logprobs")
# string fields by field number, per message, to name the one holding invalid UTF-8 (submessages: a dict)
_STRING_FIELDS: dict[int, Any] = {1: "model", 2: "text", 6: "request_id",
                                  4: {1: {1: "chat.messages.role", 2: "chat.messages.content",
                                          3: {1: "chat.messages.tool_calls.id", 2: "chat.messages.tool_calls.name",
                                              3: "chat.messages.tool_calls.arguments"},
                                          4: "chat.messages.tool_call_id"}},
                                  10: {1: {1: "tools.function.name", 2: "tools.function.description",
                                           3: "tools.function.parameters"}},
                                  11: {1: "tool_choice.mode", 2: "tool_choice.function"},
                                  5: {9: "sampling.stop"},
                                  8: {1: "structured_output.json_schema", 3: "structured_output.regex",
                                      4: "structured_output.grammar", 5: {1: "structured_output.choice"}}}


def add_InferenceServicer_to_server(servicer: Any, server: grpc.Server,  # noqa: N802 (grpc's naming)
                                    response_serializer: Any = None) -> None:
    """Ray Serve's gRPC proxy calls this (gRPCOptions.grpc_servicer_functions); requests stay raw bytes. The proxy
    serializes responses itself; a server of our own (direct_grpc.py) passes response_serializer."""
    handlers = {}
    for method in SERVICE.methods:
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(getattr(servicer, method.name, None), request_deserializer=None,
                                     response_serializer=response_serializer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))


def parse(raw: bytes, cls: type) -> Any:
    """Raw request bytes -> message, or RequestError naming the field that does not parse."""
    if not isinstance(raw, bytes):  # a proxy that already parsed it
        return raw
    try:
        return cls.FromString(raw)
    except DecodeError:
        field = _find_bad_utf8(raw, _STRING_FIELDS) if cls is pb.GenerateRequest else None
        if field:
            raise RequestError(f"{field}: invalid UTF-8 in a string field", field) from None
        raise RequestError(f"request is not a valid {cls.__name__} message", "request") from None


def generate_request(req: Any, max_request_bytes: int) -> tuple[str, GenerateRequest]:
    """A proto GenerateRequest -> (model name, the replicas' GenerateRequest of serving/protocol.py), through the
    request model HTTP shares (request_model.py): this function only reads proto fields."""
    which = req.WhichOneof("prompt")
    if which is None:
        raise RequestError("prompt: set one of text, token_ids or chat", "prompt")
    fields: dict[str, Any] = {}
    if which == "text":
        if len(req.text) > max_request_bytes:
            raise RequestError(f"text: {len(req.text)} characters exceed the limit of {max_request_bytes}", "text")
        fields["prompt"] = req.text
    elif which == "token_ids":
        fields["prompt"] = list(req.token_ids.ids)
    else:
        if sum(len(m.content) for m in req.chat.messages) > max_request_bytes:
            raise RequestError(f"chat.messages exceed the limit of {max_request_bytes} characters", "chat.messages")
        fields.update(messages=[_message(m) for m in req.chat.messages], messages_field="chat.messages")
    s = req.sampling
    sampling = {name: getattr(s, name) for name in _OPTIONAL_SAMPLING if s.HasField(name)}
    sampling.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    sampling.update(stop=list(s.stop), stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
                    logit_bias=dict(s.logit_bias))
    if req.HasField("structured_output"):
        fields["structured"] = [_structured(req.structured_output)]
    if req.tools:
        fields["tools"] = [_tool(i, t) for i, t in enumerate(req.tools)]
    if req.HasField("tool_choice"):
        fields["tool_choice"] = _tool_choice(req.tool_choice)
    api = ApiRequest(sampling=sampling, n=req.n if req.HasField("n") else 1, priority=req.priority,
                     request_id=req.request_id or None,
                     parallel_tool_calls=req.parallel_tool_calls if req.HasField("parallel_tool_calls") else True,
                     **fields)
    return req.model, to_internal(api)


def _message(m: Any) -> dict[str, Any]:
    calls = [{"id": c.id or None, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in m.tool_calls]
    return {"role": m.role, "content": m.content, "tool_calls": calls, "tool_call_id": m.tool_call_id or None}


def _tool(i: int, tool: Any) -> dict[str, Any]:
    f = tool.function
    parameters = None
    if f.parameters:
        try:
            parameters = json.loads(f.parameters)
        except json.JSONDecodeError as e:
            raise RequestError(f"tools.{i}.function.parameters: not JSON ({e})", f"tools.{i}.function.parameters") \
                from None
        if not isinstance(parameters, dict):
            raise RequestError(f"tools.{i}.function.parameters: give a JSON schema object",
                               f"tools.{i}.function.parameters")
    return {"type": "function", "function": {"name": f.name, "description": f.description or None,
                                             "parameters": parameters}}


def _tool_choice(choice: Any) -> str | dict[str, Any]:
    which = choice.WhichOneof("choice")
    if which is None:
        raise RequestError("tool_choice: set mode or function (or leave tool_choice unset for auto)", "tool_choice")
    return choice.mode if which == "mode" else {"type": "function", "function": {"name": choice.function}}


def _structured(so: Any) -> tuple[str, str, Any]:
    """(client field, engine kind, value), as request_model.ApiRequest.structured takes them."""
    kind = so.WhichOneof("kind")
    if kind is None:
        raise RequestError("structured_output: set one of json_schema, json_object, regex, grammar, choice",
                           "structured_output")
    param = f"structured_output.{kind}"
    if kind == "json_object" and not so.json_object:
        raise RequestError(f"{param}: set it to true (or leave structured_output unset for free text)", param)
    return param, kind, list(so.choice.choices) if kind == "choice" else getattr(so, kind)


def status_code(e: RequestError) -> grpc.StatusCode:
    """The gRPC status of a refused request (its message is the details)."""
    return getattr(grpc.StatusCode, e.grpc_code_name)


def _usage(u: Chunk | Usage) -> Any:
    return pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                    cached_tokens=u.cached_tokens, draft_tokens=u.draft_tokens, accepted_draft_tokens=u.accepted_tokens)


def _logprobs(chunk: Chunk) -> list[Any]:
    if chunk.logprobs is None:
        return []
    return [pb.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob,
                             top=[pb.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in lp.top])
            for lp in chunk.logprobs]


def generate_response(request_id: str, chunk: Chunk, tool_calls: list[dict[str, Any]] | None = None) -> Any:
    response = pb.GenerateResponse(request_id=request_id, text=chunk.text, token_ids=chunk.ids,
                                   finish_reason=FINISH_REASONS[chunk.finish_reason], usage=_usage(chunk),
                                   index=chunk.index)
    if chunk.logprobs is not None:  # set only when there are some: an empty list still costs its conversion
        response.logprobs.extend(_logprobs(chunk))
    if tool_calls:
        response.tool_calls.extend(_tool_calls(tool_calls))
    return response


def complete_response(request_id: str, samples: list[Chunk], tool_calls: list[dict[str, Any]] | None = None) -> Any:
    """samples: each sample's chunks merged, in index order (one for n = 1)."""
    first = samples[0]
    extra = [pb.Sample(index=i, text=m.text, token_ids=m.ids, logprobs=_logprobs(m),
                       finish_reason=FINISH_REASONS[m.finish_reason]) for i, m in enumerate(samples)]
    return pb.CompleteResponse(request_id=request_id, text=first.text, token_ids=first.ids,
                               logprobs=_logprobs(first), finish_reason=FINISH_REASONS[first.finish_reason],
                               usage=_usage(total(samples) if len(samples) > 1 else first),
                               samples=extra if len(samples) > 1 else [], tool_calls=_tool_calls(tool_calls))


def split_tool_calls(merged: Chunk, tool_format: str) -> tuple[Chunk, list[dict[str, Any]]]:
    """A request's whole output -> (its chunk with only the text before the calls, the calls in OpenAI's shape);
    a request that stopped by calling tools finishes with "tool_calls"."""
    text, calls = parse_tool_calls(tool_format, merged.text)
    reason = "tool_calls" if calls and merged.finish_reason == "stop" else merged.finish_reason
    return msgspec.structs.replace(merged, text=text or "", finish_reason=reason), calls


def _tool_calls(calls: list[dict[str, Any]] | None) -> list[Any]:
    """OpenAI-shaped calls (whole, or a stream's deltas with their index) as ToolCall messages."""
    return [pb.ToolCall(index=c.get("index", i), id=c.get("id", ""), name=c["function"].get("name", ""),
                        arguments=c["function"].get("arguments", "")) for i, c in enumerate(calls or [])]


def _find_bad_utf8(raw: bytes, fields: dict[int, Any], pos: int = 0, end: int | None = None) -> str | None:
    """Walk the protobuf wire format for a string field (as `fields` maps them) that is not UTF-8."""
    end = len(raw) if end is None else end
    try:
        while pos < end:
            key, pos = _varint(raw, pos)
            number, wire = key >> 3, key & 7
            if wire == 0:
                _, pos = _varint(raw, pos)
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            elif wire == 2:
                size, pos = _varint(raw, pos)
                target = fields.get(number)
                if isinstance(target, dict):
                    found = _find_bad_utf8(raw, target, pos, pos + size)
                    if found:
                        return found
                elif target is not None:
                    try:
                        raw[pos:pos + size].decode("utf-8")
                    except UnicodeDecodeError:
                        return target
                pos += size
            else:
                return None
    except IndexError:
        return None
    return None


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
