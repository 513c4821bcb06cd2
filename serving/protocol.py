"""The wire between the ingress and the LLMServer replicas: typed messages both sides import, and the one error type.

    Ingress --GenerateRequest (one per request, pickled)-----------> LLMServer.generate
    Ingress <--encode(Message) per streamed message (bytes)-------- LLMServer.generate
               Message = chunks: [Chunk, ...] of one request (every sample's that is ready, for n > 1)
                         error:  RequestError | None (ends the stream)

A GenerateRequest is built once, at the ingress, for both APIs (request_model.to_internal): its SamplingParams are
built (and so validated) there, and the replica fills in only what needs the model (a chat template, a tool call's
grammar, the context left for a chat without max_tokens). A Message is msgpack of msgspec Structs laid out as
arrays: the streamed message is the hot path of every token, and this is the cheapest typed encoding measured
(docs/serving.md, "What serving costs now"). An error crosses as RequestError's own fields and is raised again at
the ingress, where each API renders it: openai_responses.error_response / error_event, grpc_api.status_code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable

import msgspec

from cpuserve.engine.sampling_params import SamplingParams

# Error kinds, with their HTTP status and gRPC status-code name.
INVALID_ARGUMENT = "invalid_request_error"
NOT_FOUND = "not_found_error"
RESOURCE_EXHAUSTED = "overloaded_error"  # refused at admission: 503 with Retry-After, as vLLM's queue bounds
UNAUTHENTICATED = "authentication_error"
TOO_LARGE = "request_too_large"
UNAVAILABLE = "server_error"
HTTP_STATUS = {INVALID_ARGUMENT: 400, NOT_FOUND: 404, RESOURCE_EXHAUSTED: 503, UNAUTHENTICATED: 401,
               TOO_LARGE: 413, UNAVAILABLE: 503}
GRPC_CODE = {INVALID_ARGUMENT: "INVALID_ARGUMENT", NOT_FOUND: "NOT_FOUND", RESOURCE_EXHAUSTED: "RESOURCE_EXHAUSTED",
             UNAUTHENTICATED: "UNAUTHENTICATED", TOO_LARGE: "INVALID_ARGUMENT", UNAVAILABLE: "UNAVAILABLE"}

# max_tokens of a request that gives none: SamplingParams' default, OpenAI's 16 for /v1/completions (gRPC too);
# chat requests leave it out and the replica fills the rest of the context (GenerateRequest.fill_context)
DEFAULT_MAX_TOKENS = SamplingParams().max_tokens
MAX_N = 16  # samples per request (OpenAI's n, gRPC's GenerateRequest.n)


@dataclass(slots=True)
class RequestError(Exception):
    """A request the server refuses; `param` names the offending field (OpenAI's error.param)."""

    message: str
    param: str | None = None
    kind: str = INVALID_ARGUMENT
    retry_after: int | None = None  # seconds, for a refusal at admission (HTTP Retry-After, gRPC trailing metadata)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple:  # an exception pickles its args, which a dataclass leaves empty
        return RequestError, (self.message, self.param, self.kind, self.retry_after)

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.kind]

    @property
    def grpc_code_name(self) -> str:
        return GRPC_CODE[self.kind]

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's error object."""
        return {"message": self.message, "type": self.kind, "param": self.param, "code": None}

    @classmethod
    def from_value_error(cls, e: ValueError, default_param: str | None = None,
                         rename: dict[str, str] | None = None) -> "RequestError":
        """The engine's InvalidRequest names its param ("top_p"); another ValueError gets default_param.

        rename: a param the client knows by another name (chat's "messages" for the engine's "prompt"), renamed in
        the param and at the start of the message.
        """
        message = str(e)
        param = getattr(e, "param", None) or default_param
        if rename and param in rename:
            if message.startswith(param):
                message = rename[param] + message[len(param):]
            param = rename[param]
        return cls(message, param)


class ToolChoice(msgspec.Struct, frozen=True):
    """A required (name None: any tool) or named tool call; tool_choice "auto" is GenerateRequest.tool_choice None."""

    name: str | None = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    """One generation request, as both APIs give it once validated (request_model.to_internal builds it)."""

    sampling: SamplingParams
    prompt: str | list[int] | None = None  # a completion's prompt; else messages
    messages: list[dict[str, Any]] | None = None  # chat: {"role", "content", optional "tool_calls", "tool_call_id"}
    fill_context: bool = False  # no max_tokens given (chat): the replica gives the rest of the context
    request_id: str | None = None  # the ingress names every request before it sends it
    model: str | None = None  # the model the client named: serving/router.py sends it to a replica serving it
    priority: int = 0
    n: int = 1  # samples of the one prompt
    echo: bool = False  # completions: the prompt's text comes back before the completion
    tools: list[dict[str, Any]] | None = None  # OpenAI's shape: {"type": "function", "function": {...}}
    tool_choice: ToolChoice | None = None  # None: "auto", the model decides
    parallel_tool_calls: bool = True
    rename: dict[str, str] = {}  # engine field -> the client's name for it, for errors (chat: top_logprobs)


class TopLogprob(msgspec.Struct, array_like=True, gc=False):
    token_id: int
    text: str  # the ingress has no tokenizer, and OpenAI's shapes want token texts
    logprob: float


class Logprob(msgspec.Struct, array_like=True, gc=False):
    """One sampled token's log-probability and its top alternatives, best first."""

    token_id: int
    text: str
    logprob: float
    top: list[TopLogprob]


class Chunk(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """One sample's progress since its previous chunk (one engine step, or several merged by the pacing)."""

    ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" on a sample's last chunk
    prompt_tokens: int
    completion_tokens: int  # so far
    cached_tokens: int = 0
    draft_tokens: int = 0  # speculative decoding, so far: draft tokens verified, and of those accepted
    accepted_tokens: int = 0
    logprobs: list[Logprob] | None = None
    queue_time: float | None = None  # seconds from arrival to first scheduling, on the first chunk only
    index: int = 0  # the sample (n > 1)
    replica: str = ""  # on the first chunk: the replica serving the request
    model: str = ""  # on the first chunk: the model serving it (two answer while a model change rolls)


class Message(msgspec.Struct, array_like=True, gc=False):
    """One streamed message: chunks of one request, or the error that ends its stream (after any chunks)."""

    chunks: list[Chunk]
    error: RequestError | None = None


class ModelInfo(msgspec.Struct, kw_only=True):
    """One served model as its replicas report it (LLMServer.info, and in each ReplicaStats); both APIs list it
    (OpenAI's /v1/models, gRPC's ModelInfo, which has these fields)."""

    name: str  # what a request passes as `model`
    max_model_len: int
    weights: str
    kv_cache: str
    replicas: int
    tool_format: str


class ReplicaStats(msgspec.Struct, kw_only=True):
    """What each replica reports to the ingress every stats_interval_s (LLMServer.stats): the model it serves, its
    engine's gauges and totals so far, and its step times since its previous report."""

    replica_id: str
    model: ModelInfo
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_blocks: int
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    step_times: list[float] = []


class RoutingStats(msgspec.Struct, kw_only=True):
    """What a replica tells serving/router.py (LLMServer.record_routing_stats). Serve's request-router interface
    carries routing stats as a plain dict (RunningReplica.routing_stats, kept by Serve's controller, which imports
    none of cpuserve): `to_dict` and `of` convert at that edge."""

    model: str | None = None  # the model it serves; None: not reported yet
    kv_tokens: int | None = None  # its KV pool, which bounds the prefixes it can hold

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)

    @classmethod
    def of(cls, stats: dict[str, Any]) -> "RoutingStats":
        return msgspec.convert(stats, cls)


@dataclass(slots=True)
class Usage:
    """Token counts of a request's samples (OpenAI's usage, gRPC's Usage); see `total`."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    draft_tokens: int
    accepted_tokens: int


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, RequestError):
        return (obj.message, obj.param, obj.kind, obj.retry_after)
    raise NotImplementedError(f"no wire form for {type(obj).__name__}")


def _dec_hook(cls: type, obj: Any) -> Any:
    if cls is RequestError:
        return RequestError(*obj)
    raise NotImplementedError(f"no wire form for {cls.__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder(Message, dec_hook=_dec_hook)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)


def structured_output(kind: str, value: Any, param: str) -> dict[str, Any]:
    """The engine's structured_output for one client form (HTTP's response_format / guided_*, gRPC's oneof).

    kind: json_schema (value: the schema as a dict or JSON text), json_object, regex, grammar (Lark or GBNF) or
    choice (value: the allowed strings). param: the client's field, named by errors.
    """
    if kind == "json_schema":
        spec = value if isinstance(value, str) else json.dumps(value)
    elif kind == "choice":
        if not value or not all(isinstance(c, str) and c for c in value):
            raise RequestError(f"{param}: give a non-empty list of non-empty strings", param)
        kind, spec = "grammar", "start: " + " | ".join(json.dumps(c) for c in value)  # Lark string literals
    else:
        spec = "" if kind == "json_object" else value
    return {"kind": kind, "spec": spec}


def build_sampling(sampling: dict[str, Any], rename: dict[str, str] | None = None) -> SamplingParams:
    """The request's SamplingParams (their constructor is the one definition of what is allowed), or RequestError
    naming the client's field."""
    try:
        return SamplingParams(**sampling)
    except ValueError as e:  # InvalidRequest names the field
        raise RequestError.from_value_error(e, "sampling", rename) from None
    except TypeError as e:  # a wrong type that the comparisons inside SamplingParams choke on
        raise RequestError(f"invalid sampling parameter: {e}", "sampling") from None


def merge_chunks(chunks: list[Chunk]) -> Chunk:
    """Several consecutive chunks of one sample as one (for unary calls)."""
    last = chunks[-1]
    logprobs = None
    if any(c.logprobs is not None for c in chunks):
        logprobs = [lp for c in chunks for lp in c.logprobs or ()]
    queue_time = next((c.queue_time for c in chunks if c.queue_time is not None), None)
    return msgspec.structs.replace(last, ids=[t for c in chunks for t in c.ids], text="".join(c.text for c in chunks),
                                   logprobs=logprobs, queue_time=queue_time, replica=chunks[0].replica,
                                   model=chunks[0].model)


def merge_samples(chunks: Iterable[Chunk]) -> list[Chunk]:
    """All chunks of a request merged per sample, in index order (one sample: one merged chunk)."""
    by_index: dict[int, list[Chunk]] = {}
    for c in chunks:
        by_index.setdefault(c.index, []).append(c)
    return [merge_chunks(by_index[i]) for i in sorted(by_index)]


def total(samples: list[Chunk]) -> Usage:
    """Token counts of n samples (each its last or merged chunk): the prompt once; completions, cache hits and
    speculative drafts summed."""
    return Usage(samples[0].prompt_tokens, sum(s.completion_tokens for s in samples),
                 sum(s.cached_tokens for s in samples), sum(s.draft_tokens for s in samples),
                 sum(s.accepted_tokens for s in samples))
