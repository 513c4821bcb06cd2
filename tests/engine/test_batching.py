"""Continuous batching gives each request the tokens it would get alone, under preemption and aborts too."""

from __future__ import annotations

import pytest

from cpuserve.engine.llm import LLM
from cpuserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

TOPICS = ["the sea", "a red bicycle", "prime numbers", "the history of Rome", "how vaccines work",
          "a cat that learns to code", "autumn leaves", "the speed of light", "bread baking", "volcanoes",
          "a lighthouse keeper", "chess openings", "the moon landing", "jazz music", "honey bees", "glaciers"]


def make_prompts(llm) -> list[list[int]]:
    prompts = []
    for i, topic in enumerate(TOPICS):  # lengths differ: 0..15 repeats of a filler sentence
        text = f"Write about {topic}. " + "Be precise and concrete. " * i
        prompts.append(llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}]),
                                            add_special_tokens=False))
    return prompts


def params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=12 + i, temperature=0, ignore_eos=True)


def run_staggered(llm: LLM, prompts: list[list[int]]) -> tuple[dict[str, list[int]], int]:
    """Submit a new request every step while earlier ones are running; returns tokens by id and preemptions."""
    engine = llm.engine
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, ids = pending.pop(0)
            engine.add_request(ids, params(i), request_id=f"r{i}")
            tokens[f"r{i}"] = []
        for chunk in engine.step():
            tokens[chunk.request_id].extend(chunk.new_token_ids)
    return tokens, engine.scheduler.num_preemptions


@pytest.fixture(scope="module")
def alone(llm_fp32) -> dict[str, list[int]]:
    prompts = make_prompts(llm_fp32)
    return {f"r{i}": llm_fp32.generate([ids], params(i))[0].token_ids for i, ids in enumerate(prompts)}


def test_sixteen_staggered_requests_match_each_run_alone(llm_fp32, alone):
    tokens, _ = run_staggered(llm_fp32, make_prompts(llm_fp32))
    for request_id, expected in alone.items():
        assert tokens[request_id] == expected, request_id
    assert llm_fp32.engine.block_manager.num_free_blocks == llm_fp32.engine.block_manager.num_blocks


def test_small_pool_forces_preemption_and_all_complete_correctly(llm_fp32, alone):
    # ~20 blocks of 16 tokens: far less than the 16 requests need together, more than any one needs
    small = LLM(weights="fp32", kv_cache="fp32", kv_cache_gb=20 * 16 * llm_fp32.engine.kv_bytes_per_token / 2**30,
                show_progress=False)
    tokens, num_preemptions = run_staggered(small, make_prompts(small))
    assert num_preemptions > 0
    for request_id, expected in alone.items():
        assert tokens[request_id] == expected, request_id
    bm = small.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_aborts_mid_prefill_and_mid_decode_return_every_block(llm_fp32):
    engine = llm_fp32.engine
    prompts = make_prompts(llm_fp32)
    for i, ids in enumerate(prompts[:6]):
        engine.add_request(ids, SamplingParams(max_tokens=50, temperature=0), request_id=f"a{i}")
    engine.step()  # some prefills are partial (token budget), others done
    aborted = engine.abort_request("a0")
    assert aborted.finished and aborted.finish_reason == "abort"
    for _ in range(3):
        engine.step()
    for i in range(1, 6, 2):
        engine.abort_request(f"a{i}")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.abort_request("a0") is None  # already gone
