"""OpenAI-compatible request parsing (/v1/completions, /v1/chat/completions); responses: openai_responses.py.

Parsing is strict: wrong JSON types are errors, never coerced, and every error names its field as OpenAI's
`error.param`. Range checks are SamplingParams' own (protocol.check_sampling), so they exist once.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cpuserve.serving.protocol import DEFAULT_MAX_TOKENS, MAX_N, RequestError, check_sampling, structured_output
from cpuserve.serving.tools import NamedToolChoice, Tool, ToolCall, check_tools

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
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # which call a tool message answers

    def as_dict(self, i: int) -> dict[str, Any]:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise RequestError(f"messages.{i}.content: only an assistant message with tool_calls may leave it out",
                               f"messages.{i}.content")
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            for call in self.tool_calls:
                try:
                    json.loads(call.function.arguments)
                except json.JSONDecodeError:
                    raise RequestError(f"messages.{i}.tool_calls: arguments of {call.function.name!r} are not JSON",
                                       f"messages.{i}.tool_calls") from None
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


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
                raise RequestError(f"{name}: {why}", name)

    def structured(self) -> tuple[dict[str, Any] | None, str | None]:
        """(the engine's structured_output or None, the client field that gave it)."""
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
        if len(forms) > 1:
            raise RequestError(f"{forms[1][0]}: give one of response_format, guided_json, guided_regex, "
                               f"guided_grammar, guided_choice, not both {forms[0][0]} and {forms[1][0]}", forms[1][0])
        if not forms:
            return None, None
        param, kind, value = forms[0]
        return structured_output(kind, value, param), param

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        if not 1 <= self.n <= MAX_N:
            raise RequestError(f"n={self.n} is invalid: must be in [1, {MAX_N}]", "n")
        values = {"max_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "top_k": self.top_k, "min_p": self.min_p, "presence_penalty": self.presence_penalty,
                  "frequency_penalty": self.frequency_penalty, "logit_bias": self._logit_bias(),
                  "repetition_penalty": self.repetition_penalty, "seed": self.seed, "logprobs": logprobs,
                  "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
                  "stop_token_ids": self.stop_token_ids}
        sampling = {k: v for k, v in values.items() if v is not None}
        sampling.update(ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens)
        sampling["structured_output"], _ = self.structured()
        return sampling

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        bad = [k for k in self.logit_bias if not k.isdigit()]
        if bad:
            raise RequestError(f"logit_bias: key {bad[0]!r} is not a token id (a decimal integer)", "logit_bias")
        return {int(k): float(v) for k, v in self.logit_bias.items()}

    def internal(self, sampling: dict[str, Any], rename: dict[str, str] | None = None, **request: Any) -> dict[str, Any]:
        """The internal request dict: sampling validated, errors in the client's own field names."""
        _, param = self.structured()
        rename = {**(rename or {}), **({"structured_output": param} if param else {})}
        return {**request, "sampling": check_sampling(sampling, rename), "priority": self.priority, "rename": rename,
                "n": self.n}


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool = False

    def to_internal(self) -> dict[str, Any]:
        if self.echo:
            raise RequestError("echo=true is not supported", "echo")
        max_tokens = DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        return self.internal(self.sampling(max_tokens, self.logprobs), prompt=self.prompt)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def to_internal(self) -> dict[str, Any]:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        top = (self.top_logprobs or 0) if self.logprobs else None
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
        only = check_tools(self.tools, self.tool_choice)
        tools: dict[str, Any] = {}
        if self.tools and self.tool_choice != "none":  # "none": the model sees no tools and calls none
            choice = self.tool_choice or "auto"
            if choice != "auto" and self.structured()[0] is not None:
                raise RequestError("tool_choice: a required or named call cannot be combined with response_format "
                                   "or guided_*", "tool_choice")
            if self.n > 1:
                raise RequestError("n: tool calling takes n=1", "n")
            tools = {"tools": [t.model_dump(exclude_none=True) for t in self.tools],
                     "tool_choice": "auto" if choice == "auto" else {"name": only},  # name None = any of them
                     "parallel_tool_calls": self.parallel_tool_calls}
        # without max_tokens the replica fills the rest of the context, as OpenAI does
        return self.internal(self.sampling(max_tokens, top), {"logprobs": "top_logprobs"},
                             messages=[m.as_dict(i) for i, m in enumerate(self.messages)], **tools)


def parse_body(body: bytes, cls: type[_Sampling]) -> _Sampling:
    """Bytes of an HTTP body -> a validated request, or RequestError naming what is wrong."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"body is not valid UTF-8 (byte {e.start})", "body") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"body is not valid JSON: {e}", "body") from None
    if not isinstance(data, dict):
        raise RequestError(f"body must be a JSON object, not {type(data).__name__}", "body")
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
