"""OpenAI-compatible response shapes (/v1/completions, /v1/chat/completions): whole bodies and SSE chunks, from
the chunk dicts of serving/protocol.py, for one sample or n."""

from __future__ import annotations

import itertools
import json
import time
from typing import Any



def usage(chunk: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's usage. With speculative decoding, completion_tokens_details counts the draft tokens verified:
    accepted_prediction_tokens were kept (they are among completion_tokens), rejected_prediction_tokens were not
    (and, unlike OpenAI's predicted outputs, are not billed as completion tokens); absent when nothing drafted."""
    body = {"prompt_tokens": chunk["prompt_tokens"], "completion_tokens": chunk["completion_tokens"],
            "total_tokens": chunk["prompt_tokens"] + chunk["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": chunk["cached_tokens"]}}
    drafted, accepted = chunk.get("draft_tokens", 0), chunk.get("accepted_tokens", 0)
    if drafted:
        body["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                             "rejected_prediction_tokens": drafted - accepted}
    return body


def completion_logprobs(chunk: dict[str, Any], text_offset: int = 0) -> dict[str, Any] | None:
    """OpenAI's completions logprobs; text_offset: where the chunk's text starts in the completion (streams)."""
    if "logprobs" not in chunk:
        return None
    lps = chunk["logprobs"]  # [(id, token text, logprob, [(id, text, logprob), ...]), ...]
    offsets = list(itertools.accumulate((len(lp[1]) for lp in lps[:-1]), initial=text_offset))
    return {"tokens": [lp[1] for lp in lps], "token_logprobs": [lp[2] for lp in lps],
            "top_logprobs": [{t[1]: t[2] for t in lp[3]} for lp in lps], "text_offset": offsets if lps else []}


def chat_logprobs(chunk: dict[str, Any]) -> dict[str, Any] | None:
    if "logprobs" not in chunk:
        return None

    def entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(lp[1], lp[2]), "top_logprobs": [entry(t[1], t[2]) for t in lp[3]]}
                        for lp in chunk["logprobs"]]}


def completion_body(rid: str, model: str, chunk: dict[str, Any], chat: bool, final: bool,
                    text_offset: int = 0, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A whole response (final=True, chunk = all chunks merged) or one SSE chunk, whose text starts at text_offset
    in the completion. tool_calls: in a whole response, the calls parsed from the text (chunk["text"] is then the
    content before them, or None); in a chunk, its tool-call deltas (tool_stream.ToolCallStream)."""
    reason = chunk["finish_reason"]
    if chat:
        content = {"role": "assistant", "content": chunk["text"]}
        if tool_calls:
            content["tool_calls"] = tool_calls
            if final:
                reason = "tool_calls" if reason == "stop" else reason
            elif not chunk["text"]:
                content["content"] = None
        choice = {"index": chunk.get("index", 0), ("message" if final else "delta"): content,
                  "logprobs": chat_logprobs(chunk),
                  "finish_reason": reason}
        kind = "chat.completion" if final else "chat.completion.chunk"
    else:
        choice = {"index": chunk.get("index", 0), "text": chunk["text"],
                  "logprobs": completion_logprobs(chunk, text_offset),
                  "finish_reason": reason}
        kind = "text_completion"
    body = {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [choice]}
    if final:
        body["usage"] = usage(chunk)
    return body


def sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
