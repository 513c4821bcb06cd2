"""Speculative decoding with a draft model (engine/spec/draft_model.py) on the real model: greedy output is decoding's,
token for token, whether the draft agrees (SmolLM2 drafting for itself) or not (a random-weight model with SmolLM2's
tokenizer), in staggered runs and in one batch mixing drafting and plain requests; sampled tokens are distributed
as without it; the draft's own KV pool is all free once requests end or are cancelled, and an idle engine faults it in
as it does its own; a draft model with another vocabulary is refused by name."""

from __future__ import annotations

import pytest
from arch_factory import build_hf_model, save_hf_folder, tiny_tokenizer
from resident import missing_bytes
from spec_cases import USER_TURNS, assert_sampled_like_without, chat_ids, request_params, run_staggered

from cpuserve.engine import huge_pages
from cpuserve.engine.config import EngineConfig
from cpuserve.engine.llm import LLM
from cpuserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

ENGINE = dict(weights="int4", kv_cache="int8", kv_cache_gb=0.25, show_progress=False, speculative="draft",
              spec_max_batch=16, spec_draft_kv_cache_gb=0.05)


@pytest.fixture(scope="module")
def llm_self_draft():
    """SmolLM2 drafting for itself (the embedded model at the same int4 weights): its drafts are nearly all kept."""
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def llm_random_draft(tmp_path_factory, llm_int4):
    """A draft that disagrees: 2 layers of random weights over SmolLM2's tokenizer and vocabulary, built by
    transformers and saved as a Hugging Face folder."""
    model = build_hf_model("mistral", vocab_size=llm_int4.engine.args.vocab_size, max_position_embeddings=2048)
    folder = save_hf_folder(model, tmp_path_factory.mktemp("random_draft"), llm_int4.tokenizer)
    return LLM(**ENGINE, spec_draft_model=folder, spec_draft_weights="fp32")


def assert_draft_pool_free(llm: LLM) -> None:
    drafter = llm.engine.scheduler.drafter
    assert drafter.block_manager.num_free_blocks == drafter.block_manager.num_blocks
    assert not drafter._held
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.parametrize("which", ["self", "random"])
def test_greedy_output_is_decodings_with_requests_arriving_mid_run(which, llm_self_draft, llm_random_draft,
                                                                   decoded):
    llm = llm_self_draft if which == "self" else llm_random_draft
    prompts, want = decoded
    scheduler = llm.engine.scheduler
    drafted, accepted = scheduler.num_draft_tokens, scheduler.num_accepted_tokens
    got = run_staggered(llm, prompts)
    for i, w in enumerate(want):  # the seeded sampled one too: it never drafts
        assert got[f"r{i}"] == (w.token_ids, w.text, w.finish_reason), i
    drafted, accepted = scheduler.num_draft_tokens - drafted, scheduler.num_accepted_tokens - accepted
    if which == "self":  # the same model: only near-ties between its prompt and decode rows' rounding differ
        assert drafted > 100 and accepted > 0.8 * drafted, (drafted, accepted)
    else:
        assert drafted > 20 and accepted < 0.2 * drafted, (drafted, accepted)
    assert_draft_pool_free(llm)


def test_one_batch_mixing_drafting_and_plain_requests_decodes_the_same(llm_random_draft, decoded):
    prompts, want = decoded
    got = llm_random_draft.generate(prompts, [request_params(i) for i in range(len(prompts))])
    drafted = [o.num_draft_tokens > 0 for o in got]
    assert any(drafted) and not drafted[7]  # the seeded one never drafts
    for i, (w, g) in enumerate(zip(want, got)):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason), i
    assert [lp.logprob for lp in got[2].logprobs] == [lp.logprob for lp in want[2].logprobs]
    assert_draft_pool_free(llm_random_draft)


def test_sampled_tokens_are_distributed_as_without_speculation(llm_self_draft, llm_int4):
    """A greedy draft is a point mass on its token: verify.py's rule (keep it with probability p(d)) is speculative
    sampling's for it too (spec_cases.assert_sampled_like_without)."""
    assert_sampled_like_without(llm_self_draft, llm_int4)
    assert_draft_pool_free(llm_self_draft)


def test_cancelled_requests_leave_the_draft_pool_free(llm_self_draft):
    engine = llm_self_draft.engine
    drafter = engine.scheduler.drafter
    for i, text in enumerate(USER_TURNS[:3]):
        engine.add_request(chat_ids(llm_self_draft, text), SamplingParams(max_tokens=64, temperature=0),
                           request_id=f"c{i}")
    for _ in range(6):
        engine.step()
    assert drafter.block_manager.num_free_blocks < drafter.block_manager.num_blocks  # drafts were made
    for i in range(3):
        engine.abort_request(f"c{i}")
    assert not engine.has_unfinished_requests()
    assert_draft_pool_free(llm_self_draft)


def test_an_idle_engine_faults_the_draft_pool_in_after_its_own():
    """AsyncLLMEngine's idle work (LLMEngine.populate_kv) goes on to the draft model's pool once the model's own is
    resident, so no drafting step waits for the kernel to zero a fresh page either."""
    engine = LLM(**ENGINE).engine  # fresh pools (the module's engines have drafted into every block of theirs)
    draft = engine.scheduler.drafter.runner
    if not huge_pages.populate(draft.kv_pools[0][:1]):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
    assert missing_bytes(draft.kv_pools) > 0  # a fresh pool: nothing drafted into most of it yet
    calls = 0
    while engine.populate_kv():
        calls += 1
        assert calls < 10_000
    assert engine.runner.kv_populated and draft.kv_populated
    assert missing_bytes(engine.runner.kv_pools) == 0 and missing_bytes(draft.kv_pools) == 0
    assert not engine.populate_kv()  # done: no more work


def test_a_draft_model_with_another_vocabulary_is_refused_by_name(tmp_path, llm_int4):
    folder = save_hf_folder(build_hf_model("mistral"), tmp_path / "other", tiny_tokenizer(tmp_path))
    with pytest.raises(ValueError, match=r"spec_draft_model=.*vocabulary.*tokenizer"):
        LLM(**ENGINE, spec_draft_model=folder)


def test_draft_settings_are_checked_by_name(tmp_path):
    with pytest.raises(ValueError, match="spec_draft_model=.*speculative='draft'"):
        EngineConfig(spec_draft_model=str(tmp_path))  # a draft model, but speculation is off
    with pytest.raises(ValueError, match="spec_draft_model=.*no such file"):
        EngineConfig(speculative="draft", spec_draft_model=str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="spec_draft_weights="):
        EngineConfig(speculative="draft", spec_draft_weights="int3")
    with pytest.raises(ValueError, match="spec_draft_kv_cache_gb="):
        EngineConfig(speculative="draft", spec_draft_kv_cache_gb=0)
