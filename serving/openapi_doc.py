"""The HTTP API's OpenAPI 3.1 document, served at GET /openapi.json.

Request bodies are the request models of openai_api.py with the value rules the server enforces (SamplingParams'
ranges, request_model's roles and limits) written into them; responses are the shapes of openai_responses.py and
OpenAI's error object. A request the document excludes is refused with 4xx; tests/serving/fuzz checks that with
schemathesis (negative_data_rejection) against the running server, and that every response conforms.

A request the document allows may still be refused with 400: rules across fields (echo with logprobs, tool_choice
without tools, two structured-output forms), a prompt longer than the context in tokens, token ids past the
vocabulary, a JSON schema, regex or grammar that does not compile. Those cannot be written in JSON Schema here.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from pydantic import BaseModel

from cpuserve.engine.sampling_params import SEED_MAX, SEED_MIN
from cpuserve.serving.openai_api import IGNORED_FIELDS, ChatRequest, CompletionRequest
from cpuserve.serving.protocol import MAX_N
from cpuserve.serving.request_model import ROLES

REF = "#/components/schemas/{model}"
SEED_RANGE = {"minimum": SEED_MIN, "maximum": SEED_MAX}
_TOKEN_ID = {"type": "integer", "minimum": 0}
# JSON Schema constraints on a field's non-null value: the rules SamplingParams and request_model enforce
RULES: dict[str, dict[str, Any]] = {
    "max_tokens": {"minimum": 1}, "max_completion_tokens": {"minimum": 1},
    "temperature": {"minimum": 0}, "top_p": {"exclusiveMinimum": 0, "maximum": 1}, "top_k": {"minimum": 0},
    "min_p": {"minimum": 0, "maximum": 1}, "repetition_penalty": {"exclusiveMinimum": 0},
    "presence_penalty": {"minimum": -2, "maximum": 2}, "frequency_penalty": {"minimum": -2, "maximum": 2},
    "seed": SEED_RANGE, "n": {"minimum": 1, "maximum": MAX_N}, "logprobs": {"minimum": 0, "maximum": 20},
    "top_logprobs": {"minimum": 0, "maximum": 20}, "stop_token_ids": {"items": _TOKEN_ID},
    "logit_bias": {"propertyNames": {"pattern": "^[0-9]+$"},
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    "guided_choice": {"minItems": 1, "items": {"type": "string", "minLength": 1}},
}


SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "a chunk as JSON (object text_completion or chat.completion.chunk; with "
    "stream_options.include_usage, a last one with usage and no choices), an {\"error\": ...} object if the request "
    "fails after the 200, or [DONE] at the end"}}}


# -- responses (documentation only: openai_responses.py builds them as dicts) --------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str  # invalid_request_error, not_found_error, overloaded_error, authentication_error, ...
    param: str | None  # the offending field, e.g. "temperature", "messages.0.role", "body"
    code: None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None  # only with speculative decoding


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CalledFunctionOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunctionOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    message: str


# -- the document ----------------------------------------------------------------------------------------------
def request_schema(cls: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    """A request model's JSON schema with the server's value rules; its nested models go into components."""
    schema = cls.model_json_schema(ref_template=REF, mode="validation")
    components.update(schema.pop("$defs", {}))
    props = schema["properties"]
    for name, rules in RULES.items():
        if name in props:
            _constrain(props[name], rules)
    if "prompt" in props:  # text or token ids, never empty
        props["prompt"] = {"anyOf": [{"type": "string", "minLength": 1},
                                     {"type": "array", "items": _TOKEN_ID, "minItems": 1}]}
    _constrain(props["stop"], {"minLength": 1}, "string")
    _constrain(props["stop"], {"items": {"type": "string", "minLength": 1}}, "array")
    props.update({name: {"description": "accepted and ignored: it cannot change the output"}
                  for name in sorted(IGNORED_FIELDS)})
    schema["additionalProperties"] = False  # any other field is refused with 400 naming it
    return schema


def _constrain(prop: dict[str, Any], rules: dict[str, Any], only_type: str | None = None) -> None:
    """Add rules to the non-null branch(es) of a field's schema (pydantic writes `X | None` as anyOf)."""
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") not in (None, "null") and only_type in (None, branch.get("type")):
            branch.update(copy.deepcopy(rules))


def _json(schema: dict[str, Any] | str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": REF.format(model=schema)} if isinstance(schema, str) else schema}}


def _responses(ok: dict[str, Any], errors: dict[int, str], stream: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"200": {"description": "OK", "content": ok}}
    if stream:  # with "stream": true, server-sent events; in OpenAPI 3.1 the schema is one event's
        out["200"]["content"]["text/event-stream"] = {"schema": SSE_EVENT}
    for status, why in errors.items():
        out[str(status)] = {"description": why, "content": _json("ErrorResponse")}
    return out


def build_openapi(max_request_bytes: int, secured: bool) -> dict[str, Any]:
    """The document for a server with this body limit (HTTP 413 past it) and, when secured, API keys (401)."""
    components: dict[str, Any] = {}
    for model in (ErrorResponse, Completion, ChatCompletion, ModelList, Health):
        schema = model.model_json_schema(ref_template=REF)
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
    completion, chat = request_schema(CompletionRequest, components), request_schema(ChatRequest, components)
    components["ChatMessage"]["properties"]["role"] = {"type": "string", "enum": list(ROLES)}
    auth = {401: "missing or unknown API key"} if secured else {}
    errors = {400: "invalid request: error.param names the field", **auth, 404: "model is not served here",
              413: f"body over {max_request_bytes} bytes", 503: "overloaded (Retry-After) or shutting down"}

    def post(summary: str, body: dict[str, Any], ok: str) -> dict[str, Any]:
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": _json(body)},
                         "responses": _responses(_json(ok), errors, stream=True)}}

    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "cpuserve", "version": "v1",
                 "description": "OpenAI-compatible API; errors are OpenAI's error object naming the field."},
        "paths": {
            "/v1/completions": post("Text completion", completion, "Completion"),
            "/v1/chat/completions": post("Chat completion", chat, "ChatCompletion"),
            "/v1/models": {"get": {"summary": "The served model", "responses": _responses(_json("ModelList"), auth)}},
            "/health": {"get": {"summary": "Whether a replica answers", "responses": {
                "200": {"description": "serving", "content": _json("Health")},
                "503": {"description": "no replica answers, or shutting down", "content": _json("Health")}}}},
        },
        "components": {"schemas": components},
    }
    if secured:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/models"):
            for op in doc["paths"][path].values():
                op["security"] = [{"bearer": []}]
    return doc
