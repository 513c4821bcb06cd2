"""LLMServer's stream pacing without Ray: the message budget (stream_messages_per_s) spaces each stream's messages
by how many streams are open, and nothing is lost or reordered. (One stream under the default budget still gets
token after token: tests/serving/test_serving_streams.py, through the real stack.)"""

from __future__ import annotations

import asyncio
import time

import pytest

from cpuserve.serving.config import ServeConfig
from cpuserve.serving.llm_server import LLMServer

pytestmark = pytest.mark.slow

PROMPTS = ["The river", "A short poem about bread", "Prime numbers are", "Once upon a time"]
NUM_TOKENS = 24


def serve_all(server: LLMServer) -> list[tuple[list[float], list[dict]]]:
    """(arrival times, chunks) of one greedy stream per prompt, all at once."""

    async def one(prompt):
        arrivals, chunks = [], []
        request = {"prompt": prompt, "sampling": {"max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True}}
        async for chunk in server.generate(request):
            arrivals.append(time.monotonic())
            chunks.append(chunk)
        return arrivals, chunks

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
    from cpuserve.engine.sampling_params import SamplingParams

    results = serve_all(paced_server)
    refs = engine_alone.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True))
    for prompt, (arrivals, chunks), ref in zip(PROMPTS, results, refs):
        assert "error" not in chunks[0], chunks[0]
        # nothing lost or reordered: the same greedy tokens and text as the engine alone
        assert [t for c in chunks for t in c["ids"]] == ref.token_ids, prompt
        assert "".join(c["text"] for c in chunks) == ref.text, prompt
        assert chunks[-1]["finish_reason"] == "length"
        # the first and last messages never wait; every gap before the last one waited out 4 / 20 s
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        assert all(g >= 0.19 for g in gaps[:-1]), (prompt, gaps)
        assert len(chunks) < NUM_TOKENS / 2, f"{prompt}: {len(chunks)} messages for {NUM_TOKENS} tokens"
    assert paced_server.engine.num_streams == 0

