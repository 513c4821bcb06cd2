"""Speculative decoding on the real model: greedy output is decoding's, token for token (batches mixing drafting and
plain requests, prompts arriving mid-run, the int8 KV cache, structured outputs, stop strings), and the blocks a
request leaves in the prefix cache hold the same KV bits as without speculation."""

from __future__ import annotations

import pytest
import torch
from spec_cases import STOP, USER_TURNS, assert_sampled_like_without, chat_ids, request_params, run_staggered

from cpuserve.engine.llm import LLM
from cpuserve.engine.request import Request
from cpuserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm_spec():
    return LLM(weights="int4", kv_cache="int8", kv_cache_gb=0.25, show_progress=False, speculative="ngram",
               spec_max_batch=16)


def test_greedy_output_is_decodings_token_for_token_with_requests_arriving_mid_run(llm_spec, decoded):
    prompts, want = decoded
    before = llm_spec.engine.scheduler.num_accepted_tokens
    got = run_staggered(llm_spec, prompts)
    for i, w in enumerate(want):  # the seeded sampled one too: it never drafts, and draws only from its own generator
        assert got[f"r{i}"] == (w.token_ids, w.text, w.finish_reason), i
    stats = llm_spec.engine.stats()
    assert stats.num_accepted_tokens - before > 60  # the copy prompts drafted and were accepted
    assert stats.num_free_blocks == stats.num_blocks
    assert got["r6"][2] == "stop" and STOP not in got["r6"][1]


def test_every_request_in_one_batch_drafts_or_not_and_decodes_the_same(llm_spec, decoded):
    prompts, want = decoded
    got = llm_spec.generate(prompts, [request_params(i) for i in range(len(prompts))])
    drafted = [o.num_draft_tokens > 0 for o in got]
    assert any(drafted) and not all(drafted)  # drafting and plain requests shared the steps
    assert not drafted[7] and drafted[1]  # the seeded one never drafts; the JSON one did, under its grammar
    for i, (w, g) in enumerate(zip(want, got)):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason), i
    assert [lp.token_id for lp in got[2].logprobs] == got[2].token_ids
    assert [lp.logprob for lp in got[2].logprobs] == [lp.logprob for lp in want[2].logprobs]
    assert got[0].num_accepted_tokens <= got[0].num_draft_tokens and got[0].num_accepted_tokens > 5


def test_cached_blocks_hold_decodings_kv_bits_and_nothing_of_rejected_drafts(llm_spec, llm_int4):
    """After the same greedy request in both engines, every full block of its sequence is in each prefix cache;
    the K/V bytes (codes and scales, every layer) of each are equal: drafted positions were written as decode
    rows, and rejected ones left nothing behind that the cache kept."""
    prompt = chat_ids(llm_int4, USER_TURNS[6])
    params = SamplingParams(max_tokens=72, temperature=0)
    want = llm_int4.generate([prompt], params)[0]
    got = llm_spec.generate([prompt], params)[0]
    assert got.token_ids == want.token_ids and got.num_draft_tokens > got.num_accepted_tokens > 0
    sequence = prompt + got.token_ids[:-1]  # the last token's KV is never computed
    blocks = []
    for llm in (llm_int4, llm_spec):
        bm = llm.engine.block_manager
        probe = Request("probe", prompt, SamplingParams())
        probe.all_token_ids += got.token_ids  # keyed as the request was: prompt tokens, then generated ones
        found = bm.get_computed_blocks(probe)
        assert len(found) == len(sequence) // bm.block_size
        blocks.append(found)
    pools = [[layer.attention.kv for layer in llm.engine.runner.model.layers] for llm in (llm_int4, llm_spec)]
    for kv_a, kv_b in zip(*pools):
        ids_a, ids_b = (torch.tensor(b) for b in blocks)
        assert torch.equal(kv_a.kv[ids_a], kv_b.kv[ids_b])
        assert torch.equal(kv_a.scale[ids_a], kv_b.scale[ids_b])


def test_sampled_tokens_are_distributed_as_without_speculation(llm_spec, llm_int4):
    """n-gram drafts under the speculative-sampling rule (spec_cases.assert_sampled_like_without)."""
    assert_sampled_like_without(llm_spec, llm_int4)
