"""OpenAI response bodies from chunk dicts, without Ray: completions logprobs carry each token's character offset
in the completion text, across the chunks of a stream too."""

from __future__ import annotations

from cpuserve.serving.openai_responses import completion_body, completion_logprobs


def chunk(*tokens: str) -> dict:
    # (id, token text, logprob, top alternatives) per token, as serving/protocol.py builds them
    return {"text": "".join(tokens), "finish_reason": None,
            "logprobs": [(i, t, -0.5, [(i, t, -0.5)]) for i, t in enumerate(tokens)]}


def test_text_offset_is_each_tokens_start_in_the_completion():
    lp = completion_logprobs(chunk("Hello", ",", " wor", "ld"))
    assert lp["tokens"] == ["Hello", ",", " wor", "ld"] and lp["text_offset"] == [0, 5, 6, 10]
    assert completion_logprobs(chunk())["text_offset"] == []


def test_streamed_chunks_continue_the_offsets():
    first, second = chunk("Hel", "lo"), chunk(" there")
    body = completion_body("r", "m", second, chat=False, final=False, text_offset=len(first["text"]))
    assert body["choices"][0]["logprobs"]["text_offset"] == [5]
