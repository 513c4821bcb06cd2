"""bench/spec_cost.py's two measures run on SmolLM2 and count what they claim to: verification steps of k + 1 rows,
and plain / verification steps that account for every decoded token. A few tokens; not a measurement."""
from __future__ import annotations

import os
import sys

import pytest

pytestmark = pytest.mark.slow  # loads the real model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import spec_cost  # noqa: E402


@pytest.fixture(scope="module")
def llm():
    return spec_cost.engine_for(None, k=4, threads=2)


def test_every_step_with_drafting_on_verifies_k_draft_tokens(llm):
    one, verify, drafted = spec_cost.step_cost(llm, k=4, reps=2, steps=3)
    assert drafted == 2 * 3 * 4  # 6 steps with drafting on, 4 draft tokens each
    assert 0 < one and 0 < verify
    assert not llm.engine.has_unfinished_requests()  # the request was ended, its blocks given back
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_acceptance_counts_every_decode_step_and_token(llm):
    counts = spec_cost.acceptance(llm, max_tokens=40, prompts=2)
    # every token after each output's first (the prefill's) came from a decode step that yields at least one, and
    # a verification step at most k + 1
    assert len(counts["outputs"]) == 2 and all(1 < n <= 40 for n in counts["outputs"])
    assert counts["tokens"] == sum(counts["outputs"]) - 2
    assert counts["plain"] + counts["verify"] <= counts["tokens"] <= counts["plain"] + 5 * counts["verify"]
    assert counts["verify"] > 0  # the copy-heavy prompts draft from their own text
    assert counts["on_s"] > 0 and counts["off_s"] > 0
