"""What the ingress and the LLMServer replicas exchange: plain dicts that pickle cheaply, plus the error type.

Ingress -> LLMServer: a request dict
    {"request_id": str, "priority": int, "sampling": {SamplingParams kwargs},
     one of "prompt": str | list[int]  or  "messages": [{"role", "content"}, ...],
     "rename": {engine param: client field} when the client named a field otherwise (response_format),
     "n": samples, optional "echo": True (completions), optional "tools", "tool_choice" ("auto" | {"name": str or
     None}), "parallel_tool_calls"}; built for both APIs by request_model.to_internal
LLMServer -> ingress: a stream of chunk dicts (see `chunk_from_step`), or one {"error": ...} dict first when
the replica rejects the request (bad prompt, engine stopped), so that no exception crosses Ray.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from cpuserve.engine.outputs import StepOutput
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
# chat requests leave it out and the replica fills the rest of the context (LLMServer.generate). README: the table
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

    def to_dict(self) -> dict[str, Any]:
        return {"message": self.message, "type": self.kind, "param": self.param, "code": None}

    def to_chunk(self) -> dict[str, Any]:
        """The replica's error chunk: the OpenAI-style body, and when to retry apart from it."""
        return {"error": self.to_dict(), "retry_after": self.retry_after}

    @classmethod
    def from_dict(cls, d: dict[str, Any], retry_after: int | None = None) -> "RequestError":
        return cls(d["message"], d.get("param"), d.get("type", INVALID_ARGUMENT), retry_after)

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


def check_sampling(sampling: dict[str, Any], rename: dict[str, str] | None = None) -> dict[str, Any]:
    """Validate sampling kwargs by building SamplingParams (the one definition of what is allowed)."""
    try:
        SamplingParams(**sampling)
    except ValueError as e:
        raise RequestError.from_value_error(e, "sampling", rename) from None
    except TypeError as e:  # a wrong type that the comparisons inside SamplingParams choke on
        raise RequestError(f"invalid sampling parameter: {e}", "sampling") from None
    return sampling


def chunk_from_step(step: StepOutput, token_text: Callable[[int], str]) -> dict[str, Any]:
    """A StepOutput as a chunk dict (what crosses Ray for every streamed step).

    Logprobs become [(token id, token text, logprob, [(id, text, logprob), ...]), ...]: the ingress has no
    tokenizer, and OpenAI's shapes want token texts.
    """
    chunk: dict[str, Any] = {"ids": step.new_token_ids, "text": step.new_text,
                             "finish_reason": step.finish_reason if step.finished else None,
                             "prompt_tokens": step.num_prompt_tokens, "completion_tokens": step.num_generated_tokens,
                             "cached_tokens": step.num_cached_tokens, "draft_tokens": step.num_draft_tokens,
                             "accepted_tokens": step.num_accepted_tokens}
    if step.logprobs is not None:
        chunk["logprobs"] = [(lp.token_id, token_text(lp.token_id), lp.logprob,
                              [(t, token_text(t), p) for t, p in lp.top]) for lp in step.logprobs]
    if step.queue_time is not None:
        chunk["queue_time"] = step.queue_time
    return chunk


def merge_chunks(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Several consecutive chunks of one request as one (for unary calls and slow readers)."""
    merged = dict(chunks[-1])
    merged["ids"] = [t for c in chunks for t in c["ids"]]
    merged["text"] = "".join(c["text"] for c in chunks)
    if any("logprobs" in c for c in chunks):
        merged["logprobs"] = [lp for c in chunks for lp in c.get("logprobs", [])]
    queue_times = [c["queue_time"] for c in chunks if "queue_time" in c]
    if queue_times:
        merged["queue_time"] = queue_times[0]
    return merged


def merge_samples(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """All chunks of a request merged per sample, in index order (one sample: one merged chunk)."""
    by_index: dict[int, list[dict[str, Any]]] = {}
    for c in chunks:
        by_index.setdefault(c.get("index", 0), []).append(c)
    return [merge_chunks(by_index[i]) for i in sorted(by_index)]


def total(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Token counts of n samples: the prompt once; completions, cache hits and speculative drafts summed."""
    return {"prompt_tokens": samples[0]["prompt_tokens"],
            "completion_tokens": sum(s["completion_tokens"] for s in samples),
            "cached_tokens": sum(s["cached_tokens"] for s in samples),
            "draft_tokens": sum(s.get("draft_tokens", 0) for s in samples),
            "accepted_tokens": sum(s.get("accepted_tokens", 0) for s in samples)}
