"""The sampler as a pure function on synthetic logits."""

from __future__ import annotations

import collections
import ctypes
from dataclasses import dataclass, fields

import pytest
import torch

from cpuserve.engine.distributed import step
from cpuserve.engine.sampler import (OUTPUT_FIELDS, TOP_K_FIELDS, WHOLE_ROW, apply_penalties, logits_to_probs,
                                     num_top_logits, sample, sample_candidates, sample_scheduled, top_k_ids)
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.engine.spec.verify import draw as draw_token
from cpuserve.engine.scheduler_output import SamplingInputs, ScheduledRequest

from sampling_examples import examples


def draw(logits: torch.Tensor, p: SamplingParams, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [sample(logits[None], [p], [g], [[]], [0]).token_ids[0] for _ in range(n)]


def test_greedy_is_argmax_for_the_whole_batch():
    logits = torch.randn(5, 100)
    out = sample(logits, [SamplingParams(temperature=0)] * 5, [None] * 5, [[]] * 5, [0] * 5)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_top_p_min_p_keep_only_allowed_tokens():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])
    assert set(draw(logits, SamplingParams(temperature=1.0, top_k=2), 300)) == {0, 1}
    probs = torch.softmax(logits, -1)  # [0.64, 0.23, 0.09, ...]: the top two reach 0.87
    assert set(draw(logits, SamplingParams(temperature=1.0, top_p=0.8), 300)) == {0, 1}
    kept = logits_to_probs(logits, SamplingParams(temperature=1.0, min_p=0.2)) > 0
    assert kept.tolist() == (probs >= 0.2 * probs.max()).tolist()


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    ids = draw(logits, SamplingParams(temperature=1.0), 3000)
    freq = torch.bincount(torch.tensor(ids), minlength=3).float() / len(ids)
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.04), freq


def test_low_temperature_sharpens():
    logits = torch.tensor([1.0, 0.5, 0.0])
    ids = draw(logits, SamplingParams(temperature=0.05), 200)
    assert ids.count(0) == 200


def test_same_seed_same_tokens_regardless_of_batch_neighbours():
    logits = torch.randn(4, 50)
    p = SamplingParams(temperature=1.0)
    alone = sample(logits[2:3], [p], [torch.Generator().manual_seed(7)], [[]], [0]).token_ids
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 7, 3)]
    batch = sample(logits, [p] * 4, gens, [[]] * 4, [0] * 4).token_ids
    assert batch[2] == alone[0]


def test_repetition_and_presence_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0])
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    out = apply_penalties(logits, p, history=[0, 1], num_prompt=2)
    assert out.tolist() == [1.0, -4.0, 1.0]
    p = SamplingParams(temperature=0, presence_penalty=1.5)
    out = apply_penalties(logits, p, history=[0, 2, 2], num_prompt=1)  # only output tokens (2) are penalised
    assert out.tolist() == [2.0, -2.0, -0.5]
    # greedy with a repetition penalty changes the argmax
    ids = sample(torch.tensor([[2.0, 1.9]]), [SamplingParams(temperature=0, repetition_penalty=1.5)],
                 [None], [[0]], [1]).token_ids
    assert ids == [1]


def test_logprobs_are_the_model_distribution():
    logits = torch.randn(1, 30)
    out = sample(logits, [SamplingParams(temperature=0, logprobs=3)], [None], [[]], [0])
    lp = out.logprobs[0]
    ref = torch.log_softmax(logits[0], -1)
    assert lp.token_id == int(ref.argmax()) and lp.logprob == pytest.approx(float(ref.max()), abs=1e-6)
    assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("min_p", 2.0),
    ("repetition_penalty", 0.0), ("logprobs", 50), ("stop", [""]), ("stop_token_ids", [-3]),
])
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}="):
        SamplingParams(**{field: value})


def test_frequency_penalty_counts_each_output_occurrence():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    p = SamplingParams(temperature=0, frequency_penalty=0.5)
    out = apply_penalties(logits, p, history=[3, 0, 2, 2], num_prompt=1)  # output: 0 once, 2 twice; 3 is prompt
    assert out.tolist() == [1.5, -2.0, 0.0, 0.5]


def test_logit_bias_moves_only_its_rows_tokens():
    logits = torch.tensor([[3.0, 1.0, 0.0], [3.0, 1.0, 0.0]])
    biased = SamplingParams(temperature=0, logit_bias={0: -100, 2: 2.5})
    out = sample(logits, [biased, SamplingParams(temperature=0)], [None] * 2, [[]] * 2, [0] * 2)
    assert out.token_ids == [2, 0]  # row 0: [-97, 1, 2.5]; row 1 untouched
    with pytest.raises(ValueError):
        SamplingParams(logit_bias={1: 101})


# -- which logits decide a pick: what a replica group gathers (engine/distributed/step.py) --------------------------
def fake_token_id(text: str) -> int:
    return 1000 + sum(map(ord, text))  # examples' ids in a synthetic vocab: any fixed id per text will do


def test_every_sampling_field_has_an_example():
    """A field added to SamplingParams fails here until sampling_examples.py has a request that sets it (so the
    replica-group test runs it on 1 and 2 ranks) and the sampler declares whether it reads it."""
    names = {f.name for f in fields(SamplingParams)}
    covered = set().union(*(e.changed for e in examples(fake_token_id)))
    assert covered == names, f"no example sets {sorted(names - covered)}"
    assert OUTPUT_FIELDS | TOP_K_FIELDS <= names, sorted((OUTPUT_FIELDS | TOP_K_FIELDS) - names)


def test_a_field_the_sampler_does_not_declare_needs_the_whole_row():
    @dataclass(slots=True)
    class Extended(SamplingParams):
        new_knob: float = 0.0  # a field added later, handled by nobody yet

    def need(p):
        return num_top_logits(SamplingInputs(p, None, [], 0))

    assert need(Extended(temperature=0)) == 1 and need(Extended(temperature=0, new_knob=0.5)) == WHOLE_ROW
    assert need(Extended(temperature=1, top_k=5)) == 5 and need(Extended(temperature=1, top_k=5, new_knob=1)) == 0


@pytest.mark.parametrize("changes,want", [
    ({"temperature": 0}, 1),
    ({"temperature": 0, "top_k": 7, "top_p": 0.5, "min_p": 0.2, "seed": 3}, 1),  # greedy ignores the filters
    ({"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.1, "seed": 3}, 40),
    ({"temperature": 0.8}, WHOLE_ROW), ({"temperature": 0.8, "top_p": 0.9}, WHOLE_ROW),
    ({"temperature": 0.8, "min_p": 0.1}, WHOLE_ROW),
    ({"temperature": 0, "logit_bias": {5: 1.0}}, WHOLE_ROW), ({"temperature": 0, "logprobs": 0}, WHOLE_ROW),
    ({"temperature": 0, "repetition_penalty": 1.1}, WHOLE_ROW),
    ({"temperature": 0, "presence_penalty": 0.5}, WHOLE_ROW),
    ({"temperature": 0, "frequency_penalty": 0.5}, WHOLE_ROW),
    ({"temperature": 0, "structured_output": {"kind": "regex", "spec": "[0-9]+"}}, WHOLE_ROW),
    ({"temperature": 0, "max_tokens": 3, "stop": ["x"], "stop_token_ids": [2], "ignore_eos": True,
      "skip_special_tokens": False}, 1),
])
def test_num_top_logits_by_field(changes, want):
    assert num_top_logits(SamplingInputs(SamplingParams(**changes), None, [], 0)) == want


def test_a_grammar_needs_the_whole_row():
    assert num_top_logits(SamplingInputs(SamplingParams(temperature=0), None, [], 0, grammar=object())) == WHOLE_ROW


def test_num_candidates_is_the_largest_need_or_full():
    def inputs(*params):
        return [SamplingInputs(p, None, [], 0) for p in params]

    greedy, top_k = SamplingParams(temperature=0), SamplingParams(temperature=1, top_k=40)
    assert step.num_candidates(inputs(greedy, greedy), 1000) == 1
    assert step.num_candidates(inputs(greedy, top_k), 1000) == 40
    assert step.num_candidates(inputs(greedy, SamplingParams(temperature=0, logit_bias={3: 2.0})), 1000) == step.FULL
    assert step.num_candidates(inputs(top_k), 40) == step.FULL  # a shard of 40: gathering it whole is the same
    assert step.num_candidates([], 1000) == 1


@pytest.mark.parametrize("example", examples(fake_token_id), ids=lambda e: e.name)
def test_sampling_from_the_gathered_candidates_is_exact(example):
    """Two shards of a synthetic vocab reduced as a replica group reduces them (step.num_candidates, then
    sample_candidates): the same tokens and logprobs as sampling the whole rows. Rows 0-1 are the example's request,
    their largest logit an odd token (which the stand-in grammar forbids) that their output repeats (which the
    penalties punish), so a field that needs more than the top logits changes the pick; rows 2-3 are greedy."""
    vocab, ranks, per_rank = 4096, 2, 2048
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, vocab, generator=gen) * 3
    top = [2101, 103]  # rows 0 and 1: the top token in shard 1 and in shard 0
    for row, token in enumerate(top):
        logits[row, token] = logits[row].max() + 1
    logits[3, 100] = logits[3, 2100] = logits[3].max() + 1  # a tie across the shards: the lower id wins
    grammar = EvenTokens() if example.params.structured_output is not None else None
    greedy = SamplingParams(temperature=0)
    prompt = torch.randint(0, vocab, (20,), generator=gen).tolist()
    scheduled = [ScheduledRequest(str(i), [1], 40, True, [0], 0, SamplingInputs(
        p, torch.Generator().manual_seed(11 + i), prompt + [top[i % 2]] * 20, 20,
        grammar if p is example.params else None)) for i, p in enumerate([example.params] * 2 + [greedy] * 2)]

    def fresh():  # the same generators' states for each run
        for i, item in enumerate(scheduled):
            item.sampling.generator.manual_seed(11 + i)
        return scheduled

    want = sample_scheduled(logits.clone(), fresh())
    k = step.num_candidates([item.sampling for item in scheduled], per_rank)
    shards = logits.view(4, ranks, per_rank).transpose(0, 1)  # [ranks, S, V / ranks]
    if k == step.FULL:
        got = sample_scheduled(step.dense_from_shards(shards.contiguous(), vocab), fresh())
    else:
        gathered = torch.stack([step.local_candidates(shards[r], k, r * per_rank) for r in range(ranks)])
        got = sample_candidates(*step.split_candidates(gathered), vocab, fresh())
    assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs)
    assert want.token_ids[3] == [100]


class EvenTokens:
    """A stand-in for an llguidance matcher: allows the even token ids (its bitmask is 0x55555555 per word)."""

    def unsafe_compute_mask_ptr(self, ptr: int, nbytes: int) -> None:
        ctypes.memmove(ptr, bytes([0x55]) * nbytes, nbytes)


def test_top_k_keeps_exactly_k_tokens_the_lowest_ids_among_equal_logits():
    """bf16 logits tie often: top_k keeps k tokens, never more, and a replica group's shards, each giving its own top
    k in the same order (step.local_candidates), hold exactly those between them."""
    logits = torch.tensor([0.0, 2.0, 1.0, 1.0, 1.0, 3.0, 1.0, 1.0])
    params = SamplingParams(temperature=1.0, top_k=3)
    whole = logits_to_probs(logits, params)
    assert (whole > 0).nonzero().flatten().tolist() == [1, 2, 5]
    shards = torch.stack([step.local_candidates(logits[None, :4], 3, 0), step.local_candidates(logits[None, 4:], 3, 4)])
    values, ids = step.split_candidates(shards)
    row = torch.full((8,), float("-inf")).scatter_(0, ids[0], values[0])
    assert torch.equal(logits_to_probs(row, params), whole)


def test_top_k_ids_are_a_stable_sorts_first_k_on_rows_full_of_ties():
    """top_k_ids (no whole-row sort) keeps what a stable descending sort keeps first, in its order: the largest
    logits, the lowest ids among equals, -inf rows included."""
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        vocab = int(torch.randint(5, 300, (1,), generator=g))
        rows = torch.randint(-4, 4, (3, vocab), generator=g).float()  # eight values: ties everywhere
        if trial % 5 == 0:
            rows[0, : vocab // 2] = float("-inf")
        k = int(torch.randint(1, vocab, (1,), generator=g))
        expected = torch.sort(rows, dim=-1, descending=True, stable=True).indices[..., :k]
        assert torch.equal(top_k_ids(rows, k), expected), (trial, vocab, k)
        assert torch.equal(top_k_ids(rows[1], k), expected[1])


def test_a_draw_never_takes_a_token_of_probability_zero():
    g = torch.Generator().manual_seed(1)
    probs = torch.zeros(1000)
    probs[[3, 500, 999]] = torch.tensor([0.2, 0.5, 0.3])
    counts = collections.Counter(draw_token(probs, g) for _ in range(3000))
    assert set(counts) == {3, 500, 999}
    assert abs(counts[500] / 3000 - 0.5) < 0.05


@pytest.mark.parametrize("kwargs,param", [  # found by tests/serving/fuzz
    ({"seed": 2**64}, "seed"),  # was accepted, then torch's manual_seed overflowed in make_request ("prompt" named)
    ({"seed": -(2**63) - 1}, "seed"),
    ({"temperature": float("inf")}, "temperature"),  # was accepted: logits / inf sampled uniformly
    ({"temperature": float("nan")}, "temperature"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
])
def test_values_past_what_the_sampler_holds_are_refused(kwargs, param):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and str(e.value).startswith(param)


@pytest.mark.parametrize("seed", [-(2**63), 2**64 - 1])
def test_every_seed_taken_is_one_a_generator_takes(seed):
    torch.Generator().manual_seed(SamplingParams(seed=seed).seed)
