"""The acceptance rule: which draft tokens a step keeps, given what the model says at the draft's rows.

    one drafted request's rows:   r0 = its last token    r1 = draft d1   ...   rk = draft dk
    the logits at row j predict the token after d1..dj: the target t_j that d_{j+1} is checked against

Greedy: t_j is what the sampler picks from row j (with d1..dj in the history and taken by the grammar); the draft
is accepted while t_j == d_{j+1}, and the step yields t_0..t_a (a = the accepted count): the accepted draft tokens
and the target that disagreed, or the token after a wholly accepted draft. Each row's logits are a one-token decode's
bits (model_runner.py runs every draft row as a decode row), so the output is decoding's, token for token.

Sampled (speculative sampling: Leviathan et al. 2023, Chen et al. 2023): an n-gram draft is a point mass on d, so
d is accepted with probability p(d), p the distribution the sampler draws from at that row (after the penalties,
the grammar, temperature and the filters); otherwise the token is drawn from p with d removed, renormalised, and
the draft ends. After a wholly accepted draft the next token is drawn from the last row. Every emitted token is
then distributed as p, as without speculation (vLLM's rejection sampler does the same for draft probabilities that
are absent). The sampler (engine/sampler.py) runs the rows in order and calls these.
"""

from __future__ import annotations

import torch


def accepted_prefix(targets: list[int], draft: list[int]) -> int:
    """How many leading draft tokens equal their targets (targets[j] is checked against draft[j])."""
    num = 0
    for target, token in zip(targets, draft):
        if target != token:
            break
        num += 1
    return num


def greedy_tokens(targets: list[int], samplers: list) -> list[list[int]]:
    """Per sampling item, its new tokens from one greedy target per logit row (items own num_logit_rows rows each,
    in order): a plain decode's one target, or a draft's accepted tokens and the target after them."""
    tokens, row = [], 0
    for item in samplers:
        rows = targets[row:row + item.num_logit_rows]
        tokens.append(rows[:accepted_prefix(rows, item.draft) + 1])
        row += item.num_logit_rows
    return tokens


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token drawn from probs [V] (non-negative, summing to about 1): where one uniform number falls in their
    running sum (fp64), so a token with probability 0 is never drawn. One random number per draw whatever the row,
    so a seeded request's stream of random numbers never depends on the batch. (An exponential race, argmax p / E
    with one E ~ Exp(1) per vocabulary entry, drew 49152 numbers a row for SmolLM2: 2.7 ms a row, a 32-row step of
    sampled requests twice as long as a greedy one.)"""
    cdf = probs.to(torch.float64).cumsum(0)
    point = torch.rand(1, dtype=torch.float64, generator=generator) * cdf[-1]
    return min(int(torch.searchsorted(cdf, point, right=True)), probs.numel() - 1)


def accept_or_resample(probs: torch.Tensor, draft_token: int | None, generator: torch.Generator | None) -> int:
    """One sampled row: draft_token kept with probability probs[draft_token], else a draw from probs without it.

    probs [V], the row's final distribution (sums to 1). draft_token None: a plain draw (the row after a wholly
    accepted draft). Draws use the request's generator, as sampler._sample_row's (draw).
    """
    if draft_token is not None:
        p_draft = float(probs[draft_token])
        if torch.rand((), generator=generator, dtype=torch.float64).item() < p_draft:
            return draft_token
        probs = probs.clone()
        probs[draft_token] = 0.0
        if not probs.sum() > 0:  # p(d) was 1 up to rounding: nothing else to draw
            return draft_token
    return draw(probs, generator)
