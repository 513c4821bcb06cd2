"""gRPC side of the ingress: servicer registration for Ray Serve's proxy, request parsing, response building.

The proxy normally parses requests with the generated deserializer, and a string field holding invalid
UTF-8 then fails inside grpc as INTERNAL. We register the service with raw-bytes requests instead, so the
ingress parses them itself and answers INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import DecodeError

from cpuserve.serving.protocol import (DEFAULT_MAX_TOKENS, MAX_N, RequestError, check_sampling,
                                       structured_output, total)
from cpuserve.v1 import inference_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["Inference"]
FINISH_REASONS = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP,
                  "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}
_OPTIONAL_SAMPLING = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                      "presence_penalty", "frequency_penalty", "seed", "logprobs")
# string fields by field number, per message, to name the one holding invalid UTF-8 (submessages: a dict)
_STRING_FIELDS: dict[int, Any] = {1: "model", 2: "text", 6: "request_id",
                                  4: {1: {1: "chat.messages.role", 2: "chat.messages.content"}},
                                  5: {9: "sampling.stop"},
                                  8: {1: "structured_output.json_schema", 3: "structured_output.regex",
                                      4: "structured_output.grammar", 5: {1: "structured_output.choice"}}}


def add_InferenceServicer_to_server(servicer: Any, server: grpc.Server) -> None:  # noqa: N802 (grpc's naming)
    """Ray Serve's gRPC proxy calls this (gRPCOptions.grpc_servicer_functions); requests stay raw bytes."""
    handlers = {}
    for method in SERVICE.methods:
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(getattr(servicer, method.name, None), request_deserializer=None,
                                     response_serializer=None)
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


def generate_request(req: Any, max_request_bytes: int) -> tuple[str, dict[str, Any]]:
    """GenerateRequest -> (model name, the internal request dict of serving/protocol.py)."""
    which = req.WhichOneof("prompt")
    if which is None:
        raise RequestError("prompt: set one of text, token_ids or chat", "prompt")
    internal: dict[str, Any]
    if which == "text":
        if len(req.text) > max_request_bytes:
            raise RequestError(f"text: {len(req.text)} characters exceed the limit of {max_request_bytes}", "text")
        internal = {"prompt": req.text}
    elif which == "token_ids":
        internal = {"prompt": list(req.token_ids.ids)}
    else:
        messages = [{"role": m.role, "content": m.content} for m in req.chat.messages]
        if not messages:
            raise RequestError("chat.messages: give at least one message", "chat.messages")
        for i, m in enumerate(messages):
            if m["role"] not in ("system", "user", "assistant"):
                raise RequestError(f"chat.messages[{i}].role={m['role']!r}: use system, user or assistant",
                                   "chat.messages.role")
        if sum(len(m["content"]) for m in messages) > max_request_bytes:
            raise RequestError(f"chat.messages exceed the limit of {max_request_bytes} characters", "chat.messages")
        internal = {"messages": messages}
    s = req.sampling
    sampling = {name: getattr(s, name) for name in _OPTIONAL_SAMPLING if s.HasField(name)}
    sampling.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    sampling.update(stop=list(s.stop), stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
                    logit_bias=dict(s.logit_bias))
    rename = {}
    if req.HasField("structured_output"):
        sampling["structured_output"], param = _structured(req.structured_output)
        rename["structured_output"] = param
    internal.update(sampling=check_sampling(sampling, rename), priority=req.priority, rename=rename)
    if req.request_id:
        internal["request_id"] = req.request_id
    internal["n"] = req.n if req.HasField("n") else 1
    if not 1 <= internal["n"] <= MAX_N:
        raise RequestError(f"n={internal['n']} is invalid: must be in [1, {MAX_N}]", "n")
    return req.model, internal


def _structured(so: Any) -> tuple[dict[str, Any], str]:
    kind = so.WhichOneof("kind")
    if kind is None:
        raise RequestError("structured_output: set one of json_schema, json_object, regex, grammar, choice",
                           "structured_output")
    param = f"structured_output.{kind}"
    if kind == "json_object" and not so.json_object:
        raise RequestError(f"{param}: set it to true (or leave structured_output unset for free text)", param)
    value = list(so.choice.choices) if kind == "choice" else getattr(so, kind)
    return structured_output(kind, value, param), param


def _usage(chunk: dict[str, Any]) -> Any:
    return pb.Usage(prompt_tokens=chunk["prompt_tokens"], completion_tokens=chunk["completion_tokens"],
                    cached_tokens=chunk["cached_tokens"])


def _logprobs(chunk: dict[str, Any]) -> list[Any]:
    return [pb.TokenLogprobs(token_id=lp[0], logprob=lp[2], top=[pb.TopLogprob(token_id=t[0], logprob=t[2])
                                                                  for t in lp[3]])
            for lp in chunk.get("logprobs", [])]


def generate_response(request_id: str, chunk: dict[str, Any]) -> Any:
    return pb.GenerateResponse(request_id=request_id, text=chunk["text"], token_ids=chunk["ids"],
                               logprobs=_logprobs(chunk), finish_reason=FINISH_REASONS[chunk["finish_reason"]],
                               usage=_usage(chunk), index=chunk.get("index", 0))


def complete_response(request_id: str, samples: list[dict[str, Any]]) -> Any:
    """samples: each sample's chunks merged, in index order (one for n = 1)."""
    first = samples[0]
    extra = [pb.Sample(index=i, text=m["text"], token_ids=m["ids"], logprobs=_logprobs(m),
                       finish_reason=FINISH_REASONS[m["finish_reason"]]) for i, m in enumerate(samples)]
    return pb.CompleteResponse(request_id=request_id, text=first["text"], token_ids=first["ids"],
                               logprobs=_logprobs(first), finish_reason=FINISH_REASONS[first["finish_reason"]],
                               usage=_usage(total(samples) if len(samples) > 1 else first),
                               samples=extra if len(samples) > 1 else [])


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
