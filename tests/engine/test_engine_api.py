"""The public engine API on the real model: sampling features, bad input, and the async engine."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cpuserve.engine.async_engine import AsyncLLMEngine
from cpuserve.engine.config import EngineConfig
from cpuserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


def chat(llm, text: str) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}]),
                                add_special_tokens=False)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm_int4):
    ids = chat(llm_int4, "Tell me a story about a fox.")
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    alone = llm_int4.generate([ids], seeded)[0].token_ids
    others = [chat(llm_int4, f"Count to {n}.") for n in range(5)]
    batch = llm_int4.generate(others[:2] + [ids] + others[2:], [SamplingParams(max_tokens=30, temperature=1.0)] * 2
                              + [seeded] + [SamplingParams(max_tokens=10, temperature=0.5)] * 3)
    assert batch[2].token_ids == alone
    unseeded = llm_int4.generate([ids] * 2, SamplingParams(max_tokens=24, temperature=1.0))
    assert unseeded[0].token_ids != unseeded[1].token_ids  # no seed: independent draws


def test_stop_strings_stop_token_ids_and_max_tokens(llm_int4):
    ids = chat(llm_int4, "List the numbers from 1 to 20 separated by commas.")
    free = llm_int4.generate([ids], SamplingParams(max_tokens=60, temperature=0))[0]
    assert "5" in free.text
    cut = free.text.index("5")
    stopped = llm_int4.generate([ids], SamplingParams(max_tokens=60, temperature=0, stop=["5"]))[0]
    assert stopped.finish_reason == "stop" and stopped.text == free.text[:cut]
    third = free.token_ids[2]
    by_id = llm_int4.generate([ids], SamplingParams(max_tokens=60, temperature=0, stop_token_ids=[third]))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[:3]
    short = llm_int4.generate([ids], SamplingParams(max_tokens=5, temperature=0))[0]
    assert short.finish_reason == "length" and short.token_ids == free.token_ids[:5]


def test_eos_ends_generation(llm_int4):
    out = llm_int4.generate([chat(llm_int4, "Say hi.")], SamplingParams(max_tokens=200, temperature=0))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm_int4.tokenizer.eos_token_ids
    assert "<|im_end|>" not in out.text


def test_logprobs_match_scoring_the_same_tokens(llm_fp32):
    ids = chat(llm_fp32, "Name a color.")
    out = llm_fp32.generate([ids], SamplingParams(max_tokens=6, temperature=0, logprobs=2))[0]
    logits = llm_fp32.engine.score(ids + out.token_ids[:-1])
    ref = torch.log_softmax(logits[len(ids) - 1:], -1)
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(float(ref[i, lp.token_id]), abs=1e-3)
        assert lp.top[0][0] == lp.token_id  # greedy: the chosen token is the most likely


def test_bad_prompts_raise_and_name_the_problem(llm_int4):
    p = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm_int4.generate([""], p)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm_int4.generate([[]], p)
    too_long = [1] * llm_int4.engine.max_model_len
    with pytest.raises(ValueError, match=rf"prompt is {len(too_long)} tokens: the context holds"):
        llm_int4.generate([too_long], p)
    with pytest.raises(ValueError, match="token id 999999 is out of range"):
        llm_int4.generate([[1, 999999]], p)
    # one bad prompt among good ones: nothing starts, and the engine serves the good ones afterwards
    with pytest.raises(ValueError):
        llm_int4.generate(["hello", ""], p)
    assert not llm_int4.engine.has_unfinished_requests()
    assert len(llm_int4.generate(["hello"], p)[0].token_ids) == 4


@pytest.mark.parametrize("kwargs,match", [
    ({"model": "/nonexistent/model.gguf"}, "no such file"),
    ({"weights": "int3"}, "weights='int3' is not supported"),
    ({"kv_cache": "fp8"}, "kv_cache='fp8' is not supported"),
    ({"kv_cache_gb": 0}, "kv_cache_gb=0 must be > 0"),
    ({"block_size": 12}, "block_size=12 must be a power of two"),
    ({"colour": "red"}, "unknown engine option"),
    ({"arrival_window_ms": -1}, "arrival_window_ms=-1 must be between 0 and 1000"),
])
def test_bad_engine_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(**kwargs)


def test_async_engine_streams_cancels_and_isolates_bad_requests(llm_int4):
    engine = AsyncLLMEngine(llm_int4.engine)
    ids = chat(llm_int4, "Write a long essay about the ocean.")

    async def scenario():
        async def collect(rid, max_tokens):
            return [c async for c in engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0), rid)]

        async def cancel_after(rid, n):
            got = 0
            async for _ in engine.generate(ids, SamplingParams(max_tokens=500, temperature=0, ignore_eos=True), rid):
                got += 1
                if got == n:
                    break  # the client goes away mid-stream
            return got

        good = asyncio.create_task(collect("good", 20))
        cancelled = asyncio.create_task(cancel_after("gone", 3))
        with pytest.raises(ValueError, match="temperature=-1"):
            SamplingParams(temperature=-1)
        with pytest.raises(ValueError, match="prompt is empty"):
            async for _ in engine.generate("", SamplingParams(), "bad"):
                pass
        chunks, n_cancel = await good, await cancelled
        for _ in range(50):  # the abort lands within a step or two
            if engine.stats().num_running == 0:
                break
            await asyncio.sleep(0.05)
        return chunks, n_cancel

    try:
        chunks, n_cancel = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert n_cancel == 3
    assert [len(c.new_token_ids) for c in chunks] == [1] * len(chunks)  # one chunk per token: incremental
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    expected = llm_int4.generate([ids], SamplingParams(max_tokens=20, temperature=0))[0].token_ids
    assert [t for c in chunks for t in c.new_token_ids] == expected
    bm = llm_int4.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_arrival_window_lets_requests_sent_together_share_the_first_step(llm_int4):
    ids = chat(llm_int4, "Write a long essay about the ocean.")

    def steps(window_ms: float) -> int:
        """Engine steps to serve three requests sent 50 ms apart (3 tokens each) after an idle spell."""
        config = llm_int4.engine.config
        saved, config.arrival_window_ms = config.arrival_window_ms, window_ms
        engine = AsyncLLMEngine(llm_int4.engine)

        async def scenario():
            async def one(i: int):
                await asyncio.sleep(0.05 * i)
                params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
                return [c async for c in engine.generate(ids + [i], params, f"window-{window_ms}-{i}")]
            return await asyncio.gather(*(one(i) for i in range(3)))

        try:
            outputs = asyncio.run(scenario())
            assert all(len(o) == 3 for o in outputs)
            return len(engine.pop_step_times())
        finally:
            engine.shutdown()
            config.arrival_window_ms = saved

    assert steps(0) > 3  # the first request's prefill starts alone; the others join later steps
    assert steps(500) == 3  # one prefill step for all three (the window waits 125 ms of quiet), two decode steps


def test_lone_requests_stop_waiting_for_the_window_until_requests_come_together(llm_int4):
    """One client at a time: once LONE_ARRIVALS requests in a row each arrived more than the window after the one
    before, the next starts at once instead of waiting a quarter window for company; requests sent together (at
    once, or 30 ms apart) bring the wait back. Each request's wait is its queue_time (arrival to first scheduling,
    on its first chunk)."""
    from cpuserve.engine.async_engine import LONE_ARRIVALS

    ids = chat(llm_int4, "Name a colour.")
    config = llm_int4.engine.config
    params = SamplingParams(max_tokens=1, temperature=0)
    apart = 0.3  # seconds between requests sent alone: more than the window

    def run(gap: float):
        """LONE_ARRIVALS + 1 requests alone, 3 sent `gap` seconds apart, then one alone: the seconds each waited."""
        engine = AsyncLLMEngine(llm_int4.engine)

        async def waits(n: int, tag: str) -> list[float]:
            async def one(i: int):
                await asyncio.sleep(gap * i)
                return [c async for c in engine.generate(ids, params, f"{gap}-{tag}-{i}")][0].queue_time
            await asyncio.sleep(apart)
            return await asyncio.gather(*(one(i) for i in range(n)))

        async def scenario():
            lone = [(await waits(1, f"lone{i}"))[0] for i in range(LONE_ARRIVALS + 1)]
            return lone, await waits(3, "together"), (await waits(1, "after"))[0]

        try:
            return asyncio.run(scenario())
        finally:
            engine.shutdown()

    saved, config.arrival_window_ms = config.arrival_window_ms, 200.0  # a quarter of it: 50 ms of quiet
    try:
        runs = [run(0.0), run(0.03)]
    finally:
        config.arrival_window_ms = saved
    for lone, together, after in runs:
        assert all(w >= 0.05 for w in lone[:LONE_ARRIVALS]), lone  # each waited for company that did not come
        assert lone[-1] < 0.05 and together[0] < 0.05, (lone, together)  # then at once, the burst's first too
        assert after >= 0.05, (together, after)  # the burst brought the wait back