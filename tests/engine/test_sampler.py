"""The sampler as a pure function on synthetic logits."""

from __future__ import annotations

import pytest
import torch

from cpuserve.engine.sampler import apply_penalties, logits_to_probs, sample
from cpuserve.engine.sampling_params import SamplingParams


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
