"""A prompt's tokens and logprobs do not depend on whether its prefix came from the prefix cache, with every weight
format, on the real model: a prompt sharing a long prefix with an earlier one, and the next turn of a chat (the earlier
request's output inside its prompt), give on the engine that cached those blocks the exact floats they give with the
cache emptied.

Before fp32 prefill had a kernel of its own (engine/csrc/slim_attention_fp32.cpp), fp32 weights failed the first: the
plain-torch SlimAttention's matmuls round a row by the size of its row block, so rows computed after a cached prefix
differed from the same rows of the whole prompt. Before the prefix cache keyed blocks by role for every weight format
(block_manager.py), fp32 weights, and int4 on a CPU without AMX, failed the second: the earlier request's generated
tokens ran decode attention, the next turn's prompt rows run prefill attention, and the two round differently."""
from __future__ import annotations

import pytest
from spec_cases import PASSAGE, chat_ids

from cpuserve.engine.llm import LLM
from cpuserve.engine.outputs import RequestOutput
from cpuserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
# ~190 tokens before the question: its row blocks (the plain-torch path's 64 rows) end where the two prompts differ
CONTEXT = f"Read this passage twice.\n{PASSAGE}\n{PASSAGE}\nThe keeper's log adds: " + "the lamp was lit, " * 12


@pytest.fixture(scope="module", params=["fp32", "bf16", "int4"])
def llm(request) -> LLM:
    return LLM(weights=request.param, kv_cache_gb=0.25, show_progress=False)


def cached_and_whole(llm: LLM, first: list[int], second: list[int]) -> tuple[int, RequestOutput, RequestOutput]:
    """(blocks of second served by the cache after first ran, second's output then, second's output on an empty
    cache)."""
    block_manager = llm.engine.block_manager
    block_manager.reset_prefix_cache()
    llm.generate([first], PARAMS)
    hits = block_manager.num_hits
    cached = llm.generate([second], PARAMS)[0]
    hits = block_manager.num_hits - hits
    block_manager.reset_prefix_cache()
    return hits, cached, llm.generate([second], PARAMS)[0]


def assert_same(cached: RequestOutput, whole: RequestOutput) -> None:
    assert cached.token_ids == whole.token_ids
    assert [lp.logprob for lp in cached.logprobs] == [lp.logprob for lp in whole.logprobs]


def test_a_prompt_sharing_a_prefix_with_an_earlier_one_gets_its_logprobs(llm):
    first = chat_ids(llm, CONTEXT + "When was the lighthouse built?")
    second = chat_ids(llm, CONTEXT + "What did the lamp burn before 1934, and who left in 1989? Answer briefly.")
    hits, cached, whole = cached_and_whole(llm, first, second)
    assert hits >= 11, hits  # the shared context's full blocks
    assert_same(cached, whole)


def test_the_next_turn_of_a_chat_gets_its_logprobs(llm):
    first = chat_ids(llm, "Describe a lighthouse at night in a few sentences.")
    answer = llm.generate([first], PARAMS)[0].token_ids
    tok = llm.tokenizer
    follow_up = tok.encode("<|im_end|>\n<|im_start|>user\nNow describe it at dawn.<|im_end|>\n<|im_start|>assistant\n",
                           add_special_tokens=False)
    hits, cached, whole = cached_and_whole(llm, first, first + answer + follow_up)
    assert hits >= len(first) // 16, hits  # at least the first prompt's full blocks
    assert_same(cached, whole)
