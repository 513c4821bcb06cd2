"""bench/serving.py's client and table: tokens and TTFTs counted right on the real engine, targets judged right.

Seconds, not a measurement: the engine-alone target on SmolLM2 with a few tokens, and the table on given rows.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


@pytest.fixture(scope="module")
def serving():
    sys.path.insert(0, BENCH)  # its own imports: serve_client, serve_servers, workload
    # by file path: "serving" as a module name would collide with the repo's serving/ package
    spec = importlib.util.spec_from_file_location("cpuserve_bench_serving", os.path.join(BENCH, "serving.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # loads the real model
def test_engine_level_counts_every_token(serving):
    from cpuserve.engine.loader import default_model_path

    prompts = serving.make_prompts(3, 8, seed=0)
    with serving.engine_alone(default_model_path(), 2, 2) as targets:
        async def level():
            async with targets["engine alone"]() as send:
                return await serving.run_level(send, prompts, 2, 3)

        result = asyncio.run(level())
    assert result.errors == []
    assert result.tokens == [3, 3, 3]  # ignore_eos: exactly max_tokens each
    assert len(result.ttft) == 3 and all(0 < t < result.wall for t in result.ttft)
    row = result.row()
    assert row["tok_s"] == pytest.approx(9 / result.wall)
    assert row["ttft_p50"] <= row["ttft_p99"] and row["failed"] == row["short"] == 0


def _row(tok_s: float, p99: float, failed: int = 0) -> dict:
    return {"tok_s": tok_s, "ttft_p50": p99 / 2, "ttft_p99": p99, "done": 4 - failed, "failed": failed,
            "short": 0, "error": "HTTP 503" if failed else ""}


def test_table_judges_targets_against_the_best_peer(serving):
    args = argparse.Namespace(streams="1,32", prompt_len=128, max_tokens=128, threads=2, rounds=3)
    results = {
        "engine alone": {1: [_row(80, 10)] * 3, 32: [_row(400, 100)] * 3},
        "cpuserve HTTP": {1: [_row(60, 300), _row(61, 300), _row(100, 300)], 32: [_row(350, 900)] * 3},
        "peer A": {1: [_row(50, 200)] * 3, 32: [_row(250, 1000)] * 3},
        "peer B": {1: [_row(40, 100)] * 3, 32: [_row(300, 2000, failed=1)] * 3},
    }
    text = serving.table(results, {"peer C": "RuntimeError: no binary"}, args)
    lines = text.splitlines()
    # medians: 61 tok/s at 1 stream; peer A is best there (50), peer B at 32 (300)
    assert "| cpuserve HTTP | 1 | 61.0 | 150 | 300 | 0 of 12 |" in lines
    assert "| peer B | 32 | 300.0 | 1000 | 2000 | 3 of 12 (HTTP 503) |" in lines
    assert "| peer C | - | failed: RuntimeError: no binary | | | |" in lines
    assert "| 1 | peer A | 50.0 | 200 | 1.22x, p99 300 ms missed |" in lines  # faster, but a worse p99
    assert "| 32 | peer B | 300.0 | 2000 | 1.17x, p99 900 ms missed |" in lines  # p99 fine, < 1.2x
    assert "cpuserve HTTP at 32 streams: 88% of the engine alone (400.0 tok/s): met" in lines
