"""OpenAI-compatible response shapes (/v1/completions, /v1/chat/completions): whole bodies and SSE chunks, from
the Chunks of serving/protocol.py, for one sample or n; and a refused request as OpenAI's error."""

from __future__ import annotations

import itertools
import time
from typing import Any

import msgspec
from fastapi.responses import JSONResponse

from cpuserve.serving.protocol import Chunk, RequestError, Usage


def usage(u: Chunk | Usage) -> dict[str, Any]:
    """OpenAI's usage. With speculative decoding, completion_tokens_details counts the draft tokens verified:
    accepted_prediction_tokens were kept (they are among completion_tokens), rejected_prediction_tokens were not
    (and, unlike OpenAI's predicted outputs, are not billed as completion tokens); absent when nothing drafted."""
    body = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}
    drafted, accepted = u.draft_tokens, u.accepted_tokens
    if drafted:
        body["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                             "rejected_prediction_tokens": drafted - accepted}
    return body


def completion_logprobs(chunk: Chunk, text_offset: int = 0) -> dict[str, Any] | None:
    """OpenAI's completions logprobs; text_offset: where the chunk's text starts in the completion (streams)."""
    lps = chunk.logprobs
    if lps is None:
        return None
    offsets = list(itertools.accumulate((len(lp.text) for lp in lps[:-1]), initial=text_offset))
    return {"tokens": [lp.text for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{t.text: t.logprob for t in lp.top} for lp in lps], "text_offset": offsets if lps else []}


def chat_logprobs(chunk: Chunk) -> dict[str, Any] | None:
    if chunk.logprobs is None:
        return None

    def entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(lp.text, lp.logprob), "top_logprobs": [entry(t.text, t.logprob) for t in lp.top]}
                        for lp in chunk.logprobs]}


def completion_body(rid: str, model: str, chunk: Chunk, chat: bool, final: bool,
                    text_offset: int = 0, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A whole response (final=True, chunk = all chunks merged) or one SSE chunk, whose text starts at text_offset
    in the completion. tool_calls: in a whole response, the calls parsed from the text (chunk.text is then the
    content before them, or None); in a chunk, its tool-call deltas (tool_stream.ToolCallStream)."""
    reason = chunk.finish_reason
    if chat:
        content = {"role": "assistant", "content": chunk.text}
        if tool_calls:
            content["tool_calls"] = tool_calls
            if final:
                reason = "tool_calls" if reason == "stop" else reason
            elif not chunk.text:
                content["content"] = None
        choice = {"index": chunk.index, ("message" if final else "delta"): content,
                  "logprobs": chat_logprobs(chunk),
                  "finish_reason": reason}
        kind = "chat.completion" if final else "chat.completion.chunk"
    else:
        choice = {"index": chunk.index, "text": chunk.text,
                  "logprobs": completion_logprobs(chunk, text_offset),
                  "finish_reason": reason}
        kind = "text_completion"
    body = {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [choice]}
    if final:
        body["usage"] = usage(chunk)
    return body


_json = msgspec.json.Encoder()  # an SSE event per streamed message: ~15x faster than json.dumps here


def sse(data: dict[str, Any] | str) -> bytes:
    if isinstance(data, str):
        return f"data: {data}\n\n".encode()
    return b"data: " + _json.encode(data) + b"\n\n"


def error_response(e: RequestError) -> JSONResponse:
    """A refused request: its HTTP status and OpenAI's error body (Retry-After for a refusal at admission)."""
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
    return JSONResponse({"error": e.to_dict()}, status_code=e.http_status, headers=headers)


def error_event(e: RequestError) -> bytes:
    """A request failing after its 200 header went out: the error as an SSE event, as OpenAI's API sends it."""
    return sse({"error": e.to_dict()})
