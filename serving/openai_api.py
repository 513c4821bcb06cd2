"""OpenAI-compatible request parsing (/v1/completions, /v1/chat/completions); responses: openai_responses.py.

Parsing is strict: wrong JSON types are errors, never coerced, and every error names its field as OpenAI's
`error.param`. This module only reads JSON shapes into the request model both APIs share (request_model.py),
whose rules and messages are the gRPC API's too.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cpuserve.serving.json_body import load_object
from cpuserve.serving.protocol import DEFAULT_MAX_TOKENS, GenerateRequest, RequestError
from cpuserve.serving.request_model import ApiRequest, to_internal
from cpuserve.serving.tools import Tool, ToolCall

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


# Top-level fields accepted and ignored because they cannot change the output (bookkeeping, routing, caching
# hints). Any other field this server does not implement is refused with 400 naming it, never silently dropped.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
# fields that clients commonly send, refused with a reason (the rest get a generic one)
UNSUPPORTED = {
    "tools": "tools are for /v1/chat/completions", "tool_choice": "tools are for /v1/chat/completions",
    "functions": "function calling is not supported", "function_call": "function calling is not supported",
    "audio": "audio output is not supported", "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported", "suffix": "suffix (insertion) is not supported",
    "best_of": "best_of is not supported", "reasoning_effort": "this model has no reasoning mode",
    "web_search_options": "web search is not supported", "min_tokens": "min_tokens is not supported",
}


class _Strict(BaseModel):
    # nested objects ignore fields they do not know (a message's "name", ...); requests check theirs (_Sampling)
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str  # checked by request_model, as for gRPC
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # which call a tool message answers

    def as_dict(self) -> dict[str, Any]:
        text = self.content if isinstance(self.content, str) or self.content is None else "".join(
            p.text for p in self.content)
        return {"role": self.role, "content": text, "tool_calls": [c.model_dump() for c in self.tool_calls or []],
                "tool_call_id": self.tool_call_id}


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields are kept, then refused or ignored
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    logit_bias: dict[str, int | float] | None = None
    skip_special_tokens: bool = True
    # structured outputs: OpenAI's response_format, and vLLM's guided_* extensions (at most one of them)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None

    def check_unknown_fields(self) -> None:
        """400 for a field this server does not implement, unless it cannot change the output (IGNORED_FIELDS)."""
        for name in self.model_extra or {}:
            if name not in IGNORED_FIELDS:
                why = UNSUPPORTED.get(name, "this server does not implement it, and it could change the result")
                label = name if name.isidentifier() else json.dumps(name)  # "" or "max tokens" quoted
                raise RequestError(f"{label}: {why}", name)

    def structured(self) -> list[tuple[str, str, Any]]:
        """Every structured-output form given, as (client field, engine kind, value); request_model allows one."""
        forms = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            forms.append(("response_format", "json_object", None))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise RequestError("response_format: type json_schema needs json_schema.schema", "response_format")
            forms.append(("response_format", "json_schema", rf.json_schema.schema_))
        for kind in ("json", "regex", "grammar", "choice"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                forms.append((f"guided_{kind}", "json_schema" if kind == "json" else kind, value))
        return forms

    def api_request(self, max_tokens: int | None, logprobs: int | None, **fields: Any) -> ApiRequest:
        """This body as the request model both APIs share (validation happens in request_model.to_internal)."""
        values = {"max_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "top_k": self.top_k, "min_p": self.min_p, "presence_penalty": self.presence_penalty,
                  "frequency_penalty": self.frequency_penalty, "logit_bias": self._logit_bias(),
                  "repetition_penalty": self.repetition_penalty, "seed": self.seed, "logprobs": logprobs,
                  "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
                  "stop_token_ids": self.stop_token_ids}
        sampling = {k: v for k, v in values.items() if v is not None}
        sampling.update(ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens)
        return ApiRequest(sampling=sampling, structured=self.structured(), n=self.n, priority=self.priority,
                          **fields)

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        bad = [k for k in self.logit_bias if not (k.isascii() and k.isdigit())]  # "²".isdigit(), int("²") fails
        if bad:
            raise RequestError(f"logit_bias: key {bad[0]!r} is not a token id (a decimal integer)", "logit_bias")
        return {int(k): float(v) for k, v in self.logit_bias.items()}


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool = False

    def to_internal(self) -> GenerateRequest:
        max_tokens = DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        return to_internal(self.api_request(max_tokens, self.logprobs, prompt=self.prompt, echo=self.echo))


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Any = None  # none / auto / required / a named function: checked by tools.check_tools
    parallel_tool_calls: bool = True

    def to_internal(self) -> GenerateRequest:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        top = (self.top_logprobs or 0) if self.logprobs else None
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
        # without max_tokens the replica fills the rest of the context, as OpenAI does
        return to_internal(self.api_request(
            max_tokens, top, messages=[m.as_dict() for m in self.messages], rename={"logprobs": "top_logprobs"},
            tools=[t.model_dump() for t in self.tools] if self.tools is not None else None,
            tool_choice=self.tool_choice,
            parallel_tool_calls=self.parallel_tool_calls))


def parse_body(body: bytes, cls: type[_Sampling]) -> _Sampling:
    """Bytes of an HTTP body -> a validated request, or RequestError naming what is wrong."""
    data = load_object(body)
    try:
        parsed = cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        path = [str(p) for p in err["loc"] if str(p) not in _TYPE_TAGS and "[" not in str(p)]
        param = ".".join(path) or None
        got = "" if err["type"] == "missing" else f" (got {json.dumps(err.get('input'))[:80]})"
        raise RequestError(f"{param}: {err['msg']}{got}", param) from None
    parsed.check_unknown_fields()
    return parsed
