"""Every runtime weight format and KV cache dtype stays close to fp32 on real text."""

from __future__ import annotations

import math

import pytest
import torch

from cpuserve.engine.llm import LLM

pytestmark = pytest.mark.slow


def perplexity(llm: LLM, ids: list[int]) -> float:
    logits = llm.engine.score(ids[:-1])
    return math.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item())


@pytest.fixture(scope="module")
def text_ids(llm_fp32) -> list[int]:
    from pydoc_data.topics import topics

    return llm_fp32.tokenizer.encode(topics["class"] + topics["for"])[:2049]


@pytest.mark.parametrize("weights,kv_cache", [("int8", "int8"), ("bf16", "bf16"), ("int4", "fp32")])
def test_format_perplexity_within_2_percent_of_fp32(llm_fp32, text_ids, weights, kv_cache):
    llm = LLM(weights=weights, kv_cache=kv_cache, kv_cache_gb=0.2, show_progress=False)
    ref, got = perplexity(llm_fp32, text_ids), perplexity(llm, text_ids)
    print(f"{weights}/{kv_cache}: perplexity {got:.3f} vs fp32 {ref:.3f}")
    assert got <= ref * 1.02


def test_int8_kv_uses_about_half_the_bytes_of_bf16(llm_int4):
    from cpuserve.engine.model_runner import kv_bytes_per_token

    args = llm_int4.engine.args
    ratio = kv_bytes_per_token(args, "int8") / kv_bytes_per_token(args, "bf16")
    assert ratio <= 0.55, ratio
    pool = llm_int4.engine.runner.model.layers[0].attention.kv
    assert pool.kv.dtype == torch.int8 and pool.scale.dtype == torch.float32
