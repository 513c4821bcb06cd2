"""bench/serve_client.py's HTTP (aiohttp) and gRPC senders against a real `cpuserve serve` app, started the way
bench/serving.py starts it: output tokens counted from the server's usage, a TTFT for every request, and a refused
request kept as that level's error with its status, not a crash. Seconds, not a measurement."""
from __future__ import annotations

import asyncio
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


@pytest.fixture(scope="module")
def targets():
    sys.path.insert(0, BENCH)  # its own imports: serve_client, workload
    import serve_servers

    from cpuserve.engine.loader import default_model_path

    with serve_servers.cpuserve(default_model_path(), 1, 4) as running:
        yield running


async def level_of(target, prompts: list[list[int]], concurrency: int, max_tokens: int):
    from serve_client import run_level

    async with target() as send:
        return await run_level(send, prompts, concurrency, max_tokens)


@pytest.mark.slow  # starts Ray Serve with the real model
@pytest.mark.parametrize("path", ["HTTP", "gRPC"])
def test_sender_counts_tokens_from_usage(targets, path):
    from workload import make_prompts

    target = targets[f"cpuserve {path}"]
    level = asyncio.run(level_of(target, make_prompts(3, 16, seed=7), 2, 6))
    assert level.errors == []
    assert level.tokens == [6, 6, 6]  # ignore-eos honoured, each count from the last message's usage
    assert len(level.ttft) == 3 and all(0 < t < level.wall for t in level.ttft)
    assert level.row()["done"] == 3 and level.row()["short"] == 0


@pytest.mark.slow
def test_refused_request_is_the_levels_error(targets):
    level = asyncio.run(level_of(targets["cpuserve HTTP"], [[1, 2, 10**9]], 1, 4))  # a token id past the vocabulary
    assert level.tokens == [] and len(level.errors) == 1
    assert level.errors[0].startswith("RuntimeError: HTTP 400")
    assert level.row()["failed"] == 1
