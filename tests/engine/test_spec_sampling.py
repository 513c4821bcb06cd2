"""The acceptance rule (engine/spec/verify.py, sampler.sample_draft) on synthetic logits: greedy keeps the agreeing
prefix and the target after it; sampled drafts leave every token distributed as the sampler's own distribution."""

from __future__ import annotations

import collections

import pytest
import torch

from cpuserve.engine.sampler import logits_to_probs, sample_draft
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.engine.scheduler_output import SamplingInputs


def inputs(params: SamplingParams, seed: int = 0, grammar=None, history=(1, 2, 3)) -> SamplingInputs:
    return SamplingInputs(params, torch.Generator().manual_seed(seed), list(history), 2, grammar)


def rows_with_argmax(argmax: list[int], vocab: int = 16) -> torch.Tensor:
    rows = torch.randn(len(argmax), vocab, generator=torch.Generator().manual_seed(5))
    for j, t in enumerate(argmax):
        rows[j, t] = rows[j].max() + 2.0
    return rows


def test_greedy_keeps_the_agreeing_prefix_and_the_target_after_it():
    rows = rows_with_argmax([5, 6, 2])  # row j: the target after draft[:j]
    assert sample_draft(rows, inputs(SamplingParams(temperature=0)), [5, 7])[0] == [5, 6]
    assert sample_draft(rows, inputs(SamplingParams(temperature=0)), [5, 6])[0] == [5, 6, 2]  # all accepted + 1
    assert sample_draft(rows, inputs(SamplingParams(temperature=0)), [9, 6])[0] == [5]
    tokens, logprobs = sample_draft(rows, inputs(SamplingParams(temperature=0, logprobs=2)), [5, 7])
    raw = torch.log_softmax(rows, -1)
    assert [lp.token_id for lp in logprobs] == [5, 6]
    assert [lp.logprob for lp in logprobs] == [float(raw[0, 5]), float(raw[1, 6])]
    assert [t for t, _ in logprobs[1].top] == raw[1].topk(2).indices.tolist()


def test_greedy_with_a_penalty_sees_each_accepted_draft_token_in_its_history():
    # row 1's best is 5 by a little; once 5 (accepted at row 0) is in the history, the presence penalty drops it
    rows = torch.zeros(2, 8)
    rows[0, 5], rows[1, 5], rows[1, 6] = 3.0, 2.0, 1.5
    params = SamplingParams(temperature=0, presence_penalty=1.0)
    assert sample_draft(rows, inputs(params), [5, 5])[0] == [5, 6]
    assert sample_draft(rows, inputs(SamplingParams(temperature=0)), [5, 5])[0] == [5, 5]


class OddTokensForbidden:
    """A stand-in llguidance matcher: allows even token ids; records what it takes and rolls back."""

    def __init__(self):
        self.consumed: list[int] = []

    def unsafe_compute_mask_ptr(self, ptr: int, nbytes: int) -> None:
        import ctypes

        ctypes.memset(ptr, 0x55, nbytes)  # bits 0, 2, 4, ... of each byte: the even ids

    def consume_token(self, token: int) -> bool:
        assert token % 2 == 0, f"the matcher was fed a forbidden token {token}"
        self.consumed.append(token)
        return True

    def rollback(self, n: int) -> bool:
        del self.consumed[len(self.consumed) - n:]
        return True


def test_a_draft_token_the_grammar_forbids_is_rejected_and_the_grammar_is_rolled_back():
    rows = rows_with_argmax([4, 7, 3])  # row 1's raw best, 7, is odd: the grammar forbids it
    grammar = OddTokensForbidden()
    tokens, _ = sample_draft(rows, inputs(SamplingParams(temperature=0), grammar=grammar), [4, 7])
    assert tokens == [4, int(rows[1, ::2].argmax()) * 2]  # 7 rejected; the best even token instead
    assert grammar.consumed == []  # the output processor feeds it the kept tokens itself
    for seed in range(20):  # sampled: p(7) is 0 under the mask, so 7 is never kept and nothing odd is drawn
        tokens, _ = sample_draft(rows, inputs(SamplingParams(temperature=1.0), seed, grammar), [4, 7])
        assert all(t % 2 == 0 for t in tokens) and (tokens[0] == 4 if len(tokens) == 2 else len(tokens) == 1)
        assert grammar.consumed == []


def chi_square_p(counts: collections.Counter, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of counts against probs (cells with expected count >= 5)."""
    n = sum(counts.values())
    expected = probs.double() * n
    cells = [t for t in range(len(probs)) if expected[t] >= 5]
    assert sum(counts[t] for t in range(len(probs)) if t not in cells) <= 0.01 * n + 5
    stat = sum((counts[t] - expected[t]) ** 2 / expected[t] for t in cells)
    return float(torch.special.gammaincc(torch.tensor((len(cells) - 1) / 2.0, dtype=torch.float64), stat / 2.0))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)],
                         ids=["t1", "t0.7-top4"])
def test_sampled_drafts_leave_each_token_distributed_as_the_model_says(params):
    """Row j's distribution p_j is the law of the token after draft[:j]: the first token follows p_0, the second
    (emitted in the same step only after d1 was accepted) follows p_1, the third p_2, whatever the draft proposes."""
    vocab, n = 6, 10000
    rows = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)) * 1.5
    draft = [int(rows[0].argmax()), int(rows[1].argsort()[-2])]  # a likely token, then a second-best one
    probs = [logits_to_probs(rows[j], params) for j in range(3)]
    gen = torch.Generator().manual_seed(2)
    first, second, third = collections.Counter(), collections.Counter(), collections.Counter()
    for _ in range(n):
        tokens, _ = sample_draft(rows, SamplingInputs(params, gen, [0], 1), draft)
        first[tokens[0]] += 1
        if tokens[0] == draft[0] and len(tokens) > 1:
            second[tokens[1]] += 1
            if tokens[1] == draft[1] and len(tokens) > 2:
                third[tokens[2]] += 1
    assert sum(second.values()) == first[draft[0]]  # after an accepted d1 a second token always comes
    assert sum(third.values()) == second[draft[1]]
    assert sum(third.values()) > 300  # both acceptances were exercised
    for counts, p in ((first, probs[0]), (second, probs[1]), (third, probs[2])):
        assert chi_square_p(counts, p) > 1e-3, (counts, p)
    # the test has power: accepting the draft whenever it is proposed would put all the mass on d1
    assert abs(first[draft[0]] / n - float(probs[0][draft[0]])) < 0.03
