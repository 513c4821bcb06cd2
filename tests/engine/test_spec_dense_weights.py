"""Speculative decoding with fp32 and bf16 weights on the real model: greedy output is decoding's, token for token,
with n-gram drafts and with a draft model, requests arriving mid-run and in one batch. A verification row runs
dense_gemm as a one-token decode does (engine/layers/linear/dense.py). With every layer on F.linear instead (whose
rounding follows the batch's size; DenseLinear.use_torch_gemm) the one-batch test failed: with bf16 weights 2 of the 7
greedy requests had other logprobs, with fp32 one of the 8 requests other tokens."""

from __future__ import annotations

import pytest
from arch_factory import build_hf_model, save_hf_folder
from spec_cases import assert_same_outputs, decode_all, request_params, run_staggered

from cpuserve.engine.layers import native
from cpuserve.engine.llm import LLM

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not native.dense_gemm_enabled(), reason="dense_gemm is not built here: speculation "
                                 "refuses fp32 / bf16 weights (test_dense_gemm.py checks that)")]
ENGINE = dict(kv_cache="int8", kv_cache_gb=0.25, show_progress=False)
SPEC = dict(spec_max_batch=16)


def params(i: int):
    """spec_cases' request i, every greedy one with its tokens' logprobs: their exact floats show a row that rounded
    otherwise even where no token flipped (bf16's F.linear rounds a one-row decode unlike more rows in few places)."""
    p = request_params(i)
    if p.temperature == 0:
        p.logprobs = 1
    return p


@pytest.fixture(scope="module", params=["bf16", "fp32"])
def plain(request):
    """(weights, engine without speculation, decode_all's prompts and outputs)."""
    llm = LLM(weights=request.param, **ENGINE)
    return request.param, llm, decode_all(llm, params)


@pytest.fixture(scope="module")
def ngram(plain):
    return LLM(weights=plain[0], **ENGINE, speculative="ngram", **SPEC)


@pytest.fixture(scope="module")
def random_draft(plain, tmp_path_factory):
    """A draft that mostly disagrees (2 random layers over SmolLM2's tokenizer): many verification rows rejected."""
    weights, llm, _ = plain
    model = build_hf_model("mistral", vocab_size=llm.engine.args.vocab_size, max_position_embeddings=2048)
    folder = save_hf_folder(model, tmp_path_factory.mktemp("random_draft"), llm.tokenizer)
    return LLM(weights=weights, **ENGINE, speculative="draft", spec_draft_model=folder, spec_draft_weights="fp32",
               spec_draft_kv_cache_gb=0.05, **SPEC)


@pytest.mark.parametrize("drafter", ["ngram", "random_draft"])
def test_greedy_output_is_decodings_with_requests_arriving_mid_run(drafter, plain, request):
    llm = request.getfixturevalue(drafter)
    (prompts, want), scheduler = plain[2], llm.engine.scheduler
    drafted, accepted = scheduler.num_draft_tokens, scheduler.num_accepted_tokens
    assert_same_outputs(run_staggered(llm, prompts, params), want)
    drafted, accepted = scheduler.num_draft_tokens - drafted, scheduler.num_accepted_tokens - accepted
    if drafter == "ngram":  # the copy prompts drafted and were accepted
        assert drafted > accepted > 60, (drafted, accepted)
    else:  # each step verified rows that were rejected
        assert drafted > 20 and accepted < 0.2 * drafted, (drafted, accepted)


@pytest.mark.parametrize("drafter", ["ngram", "random_draft"])
def test_one_batch_mixing_drafting_and_plain_requests_decodes_the_same(drafter, plain, request):
    llm = request.getfixturevalue(drafter)
    prompts, want = plain[2]  # the prompts' blocks are in the prefix cache (the staggered test's): the same floats
    got = llm.generate(prompts, [params(i) for i in range(len(prompts))])
    drafted = [o.num_draft_tokens > 0 for o in got]
    assert any(drafted) and not drafted[7]  # the seeded sampled one never drafts
    for i, (w, g) in enumerate(zip(want, got)):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason), i
        if w.logprobs is not None:
            assert [lp.logprob for lp in g.logprobs] == [lp.logprob for lp in w.logprobs], i
