"""OpenAI response bodies from protocol Chunks, without Ray: completions logprobs carry each token's character offset
in the completion text, across the chunks of a stream too."""

from __future__ import annotations

from cpuserve.serving.openai_responses import completion_body, completion_logprobs
from cpuserve.serving.protocol import Chunk, Logprob, TopLogprob


def chunk(*tokens: str) -> Chunk:
    return Chunk(list(range(len(tokens))), "".join(tokens), None, 3, len(tokens),
                 logprobs=[Logprob(i, t, -0.5, [TopLogprob(i, t, -0.5)]) for i, t in enumerate(tokens)])


def test_text_offset_is_each_tokens_start_in_the_completion():
    lp = completion_logprobs(chunk("Hello", ",", " wor", "ld"))
    assert lp["tokens"] == ["Hello", ",", " wor", "ld"] and lp["text_offset"] == [0, 5, 6, 10]
    assert completion_logprobs(chunk())["text_offset"] == []


def test_streamed_chunks_continue_the_offsets():
    first, second = chunk("Hel", "lo"), chunk(" there")
    body = completion_body("r", "m", second, chat=False, final=False, text_offset=len(first.text))
    assert body["choices"][0]["logprobs"]["text_offset"] == [5]
