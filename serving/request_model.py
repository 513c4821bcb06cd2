"""One request model for both APIs: an HTTP body (openai_api.py) and a gRPC GenerateRequest (grpc_api.py) are each
read into an ApiRequest, and `to_internal` validates it and builds the GenerateRequest the replicas take
(protocol.py), its SamplingParams included.

The readers only translate wire shapes (JSON types, proto fields); every rule about values lives here, in
SamplingParams (ranges) and in tools.check_tools, so both APIs refuse the same request with the same message
naming the same field (`temperature`, `tools.0.function.name`, `tool_choice`, `n`, ...). Where the two APIs name
a thing differently (HTTP's `guided_regex`, gRPC's `structured_output.regex`; `messages` / `chat.messages`), the
reader passes the client's name along with the value, and errors use it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from cpuserve.serving.protocol import (MAX_N, GenerateRequest, RequestError, ToolChoice, build_sampling,
                                       structured_output)
from cpuserve.serving.tools import check_tools

ROLES = ("system", "user", "assistant", "developer", "tool")


@dataclass(slots=True)
class ApiRequest:
    """A generation request as either API gives it, before validation."""

    prompt: str | list[int] | None = None  # a completion's prompt; else messages
    messages: list[dict[str, Any]] | None = None  # {"role", "content", optional "tool_calls", "tool_call_id"}
    messages_field: str = "messages"  # the client's name for them (gRPC: chat.messages)
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams kwargs the client set
    # every structured-output form the client gave: (client field, kind, value); at most one is allowed
    structured: list[tuple[str, str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None  # OpenAI's shape: {"type": "function", "function": {...}}
    tool_choice: str | dict[str, Any] | None = None  # none / auto / required / {"function": {"name": ...}}
    parallel_tool_calls: bool = True
    n: int = 1
    priority: int = 0
    request_id: str | None = None
    echo: bool = False  # completions: the prompt's text comes back before the completion
    rename: dict[str, str] = field(default_factory=dict)  # engine field -> the client's (chat: top_logprobs)


def to_internal(req: ApiRequest) -> GenerateRequest:
    """The request the replicas take, or RequestError naming the client's field."""
    if not 1 <= req.n <= MAX_N:
        raise RequestError(f"n={req.n} is invalid: must be in [1, {MAX_N}]", "n")
    sampling, rename = dict(req.sampling), dict(req.rename)
    if len(req.structured) > 1:
        (first, *_), (second, *_) = req.structured[:2]
        raise RequestError(f"{second}: give one structured-output form, not both {first} and {second}", second)
    if req.structured:
        param, kind, value = req.structured[0]
        sampling["structured_output"] = structured_output(kind, value, param)
        rename["structured_output"] = param
    fields: dict[str, Any] = {}
    if req.messages is not None:
        fields["messages"] = _messages(req.messages, req.messages_field)
    else:
        fields["prompt"] = req.prompt
    fields.update(_tools(req, bool(req.structured)))
    if req.echo:
        if req.messages is not None:
            raise RequestError("echo: only completions echo their prompt", "echo")
        if sampling.get("logprobs") is not None:
            raise RequestError("echo: echo with logprobs would need the prompt's logprobs, which this server does "
                               "not compute; drop one of echo and logprobs", "echo")
        fields["echo"] = True
    return GenerateRequest(sampling=build_sampling(sampling, rename), fill_context="max_tokens" not in sampling,
                           priority=req.priority, rename=rename, n=req.n, request_id=req.request_id or None, **fields)


def _tools(req: ApiRequest, structured: bool) -> dict[str, Any]:
    only = check_tools(req.tools, req.tool_choice)
    if not req.tools or req.tool_choice == "none":  # "none": the model sees no tools and calls none
        return {}
    if req.messages is None:
        raise RequestError("tools: tool calling needs a chat prompt (messages)", "tools")
    choice = req.tool_choice or "auto"
    if choice != "auto" and structured:
        raise RequestError("tool_choice: a required or named call cannot be combined with a structured-output "
                           "form (response_format, guided_*, structured_output)", "tool_choice")
    if req.n > 1:
        raise RequestError("n: tool calling takes n=1", "n")
    tools = [{"type": "function", "function": {k: v for k, v in t["function"].items() if v is not None}}
             for t in req.tools]
    return {"tools": tools, "tool_choice": None if choice == "auto" else ToolChoice(only),  # name None = any
            "parallel_tool_calls": req.parallel_tool_calls}


def _messages(messages: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    if not messages:
        raise RequestError(f"{name}: give at least one message", name)
    out = []
    for i, m in enumerate(messages):
        where = f"{name}.{i}"
        if m["role"] not in ROLES:
            raise RequestError(f"{where}.role={m['role']!r}: use one of {', '.join(ROLES)}", f"{where}.role")
        calls = m.get("tool_calls") or []
        if calls and m["role"] != "assistant":
            raise RequestError(f"{where}.tool_calls: only an assistant message has tool calls", f"{where}.tool_calls")
        if m.get("content") is None and not calls:
            raise RequestError(f"{where}.content: only an assistant message with tool_calls may leave it out",
                               f"{where}.content")
        for call in calls:
            try:
                json.loads(call["function"]["arguments"])
            except json.JSONDecodeError:
                raise RequestError(f"{where}.tool_calls: arguments of {call['function']['name']!r} are not JSON",
                                   f"{where}.tool_calls") from None
        entry = {"role": "system" if m["role"] == "developer" else m["role"], "content": m.get("content") or ""}
        if calls:
            entry["tool_calls"] = calls
        if m.get("tool_call_id"):
            entry["tool_call_id"] = m["tool_call_id"]
        out.append(entry)
    return out
