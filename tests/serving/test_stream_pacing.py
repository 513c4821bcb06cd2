"""Stream pacing without Ray (serving/pacing.py over the real engine): a slow consumer gets merged chunks, a minimum
interval spaces them, and LLMServer's message budget (stream_messages_per_s) spaces each stream's messages by how
many streams are open; nothing is lost or reordered. (One stream under the default budget still gets token after
token: tests/serving/test_serving_streams.py, through the real stack.)"""

from __future__ import annotations

import asyncio
import time

import pytest

from cpuserve.engine.async_engine import AsyncLLMEngine
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.serving.config import ServeConfig
from cpuserve.serving.llm_server import LLMServer
from cpuserve.serving.pacing import paced
from cpuserve.serving.protocol import GenerateRequest, Message, decode

pytestmark = pytest.mark.slow

PROMPTS = ["The river", "A short poem about bread", "Prime numbers are", "Once upon a time"]
NUM_TOKENS = 24


def chat(llm, text: str) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}]),
                                add_special_tokens=False)


def serve_all(server: LLMServer) -> list[tuple[list[float], list[Message]]]:
    """(arrival times, messages) of one greedy stream per prompt, all at once, as the ingress decodes them."""

    async def one(prompt):
        arrivals, messages = [], []
        request = GenerateRequest(prompt=prompt, sampling=SamplingParams(max_tokens=NUM_TOKENS, temperature=0,
                                                                          ignore_eos=True))
        async for data in server.generate(request):
            arrivals.append(time.monotonic())
            messages.append(decode(data))
        return arrivals, messages

    async def run():
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    return asyncio.run(run())


@pytest.fixture(scope="module")
def paced_server():
    # 4 streams share 20 messages/s: each stream's messages at least 0.2 s apart
    server = LLMServer(ServeConfig(cpus_per_rank=1, kv_cache_gb=0.1, stream_messages_per_s=20))
    yield server
    server.engine.shutdown()


def test_message_budget_spaces_each_stream_by_the_open_streams(paced_server, engine_alone):
    results = serve_all(paced_server)
    refs = engine_alone.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True))
    for prompt, (arrivals, messages), ref in zip(PROMPTS, results, refs):
        assert all(m.error is None and len(m.chunks) == 1 for m in messages), messages[0]
        chunks = [m.chunks[0] for m in messages]
        # nothing lost or reordered: the same greedy tokens and text as the engine alone
        assert [t for c in chunks for t in c.ids] == ref.token_ids, prompt
        assert "".join(c.text for c in chunks) == ref.text, prompt
        assert chunks[-1].finish_reason == "length"
        # the first and last messages never wait; every gap before the last one waited out 4 / 20 s
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        assert all(g >= 0.19 for g in gaps[:-1]), (prompt, gaps)
        assert len(chunks) < NUM_TOKENS / 2, f"{prompt}: {len(chunks)} messages for {NUM_TOKENS} tokens"
    assert paced_server.engine.num_streams == 0


def test_paced_coalesces_tokens_for_a_slow_consumer(engine_alone):
    engine = AsyncLLMEngine(engine_alone.engine)
    ids = chat(engine_alone, "Describe a forest.")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    async def slow_reader():
        chunks = []
        async for chunk in paced(engine.generate(ids, params, "slow")):
            chunks.append(chunk)
            await asyncio.sleep(0.1)  # several engine steps pass while the reader is busy
        return chunks

    try:
        chunks = asyncio.run(slow_reader())
    finally:
        engine.shutdown()
    expected = engine_alone.generate([ids], params)[0]
    assert len(chunks) < 24 and any(len(c.new_token_ids) > 1 for c in chunks)
    assert [t for c in chunks for t in c.new_token_ids] == expected.token_ids
    assert "".join(c.new_text for c in chunks) == expected.text
    assert chunks[-1].finished and chunks[-1].num_generated_tokens == 24


def test_paced_spaces_chunks_by_min_interval(engine_alone):
    engine = AsyncLLMEngine(engine_alone.engine)
    ids = chat(engine_alone, "Describe a river.")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    async def reader():
        arrivals, chunks = [], []
        async for chunk in paced(engine.generate(ids, params, "paced"), min_interval=0.1):
            arrivals.append(time.monotonic())
            chunks.append(chunk)
        return arrivals, chunks

    try:
        arrivals, chunks = asyncio.run(reader())
    finally:
        engine.shutdown()
    expected = engine_alone.generate([ids], params)[0]
    assert [t for c in chunks for t in c.new_token_ids] == expected.token_ids  # nothing lost or reordered
    assert chunks[-1].finished and chunks[-1].num_generated_tokens == 24
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    # every chunk but the last waited out the interval; a fast reader alone would get 24 chunks of one token
    assert all(g >= 0.095 for g in gaps[:-1]), gaps
    assert len(chunks) < 24 and any(len(c.new_token_ids) > 1 for c in chunks)
