"""What the speculative-decoding tests run (test_speculative.py: n-gram drafts; test_spec_draft_model.py: a draft
model): chat prompts that copy (code, JSON, a passage, a tool result) and open ones, each with its sampling
parameters, a staggered run, and a chi-square test of two samples."""

from __future__ import annotations

import collections
import json

import torch

from cpuserve.engine.llm import LLM
from cpuserve.engine.sampling_params import SamplingParams

CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    return subtotal * (1 + tax_rate)
'''
PASSAGE = ("The lighthouse on Skerry Point was built in 1871 from granite quarried on the island itself. Its lamp "
           "burned paraffin until 1934, when it was converted to electricity, and the last keeper left in 1989.")
TOOL = '{"city": "Oslo", "forecast": [{"day": "Mon", "high": 4, "low": -2}, {"day": "Tue", "high": 6, "low": 0}]}'
USER_TURNS = [
    f"Rename subtotal to running_total in this code and return the whole function:\n{CODE}",
    'Fix this JSON and return it: {"name": "Ann", "age": 31, "tags": ["a", "b",], "city": "Paris",}',
    f"Quoting the passage exactly, when was the lamp converted to electricity?\n{PASSAGE}",
    f"The weather tool returned:\n{TOOL}\nSummarise the forecast, repeating the numbers.",
    "Write a short poem about autumn leaves.",
    "What is the capital of Japan? Answer in one sentence.",
    f"Repeat this code exactly:\n{CODE}",
    "List three prime numbers.",
]
STOP = " * (1 + tax_rate) * (1 + tax_rate) *"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}


def chat_ids(llm: LLM, text: str) -> list[int]:
    tok = llm.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def request_params(i: int) -> SamplingParams:
    if i == 1:  # a JSON schema: drafts from the prompt's JSON must pass the grammar too
        return SamplingParams(max_tokens=40, temperature=0, structured_output={"kind": "json_schema",
                                                                               "spec": json.dumps(SCHEMA)})
    if i == 6:  # a stop string inside text the drafter proposes (this model repeats "(1 + tax_rate) *" here)
        return SamplingParams(max_tokens=64, temperature=0, stop=[STOP])
    if i == 7:  # seeded sampling never drafts: a plain row in a drafting batch
        return SamplingParams(max_tokens=24, temperature=0.8, seed=7)
    return SamplingParams(max_tokens=36 + 2 * i, temperature=0, logprobs=1 if i == 2 else None)


def decode_all(llm: LLM, params=request_params) -> tuple[list[list[int]], list]:
    """USER_TURNS without speculation, in one batch (batching never changes a request's tokens: test_batching.py):
    (prompts, outputs), what the speculative runs must reproduce; params(i): request i's SamplingParams."""
    prompts = [chat_ids(llm, t) for t in USER_TURNS]
    return prompts, llm.generate(prompts, [params(i) for i in range(len(prompts))])


def assert_same_outputs(got: dict[str, tuple[list[int], str, str]], want: list) -> None:
    """run_staggered's results are want's (generate's outputs), token for token, text and finish reason."""
    for i, w in enumerate(want):
        assert got[f"r{i}"] == (w.token_ids, w.text, w.finish_reason), i


def run_staggered(llm: LLM, prompts: list[list[int]], params=request_params) -> dict[str, tuple[list[int], str, str]]:
    """A new request every step while the others run: prefill chunks and drafts share steps."""
    engine, results, pending = llm.engine, {}, list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, ids = pending.pop(0)
            engine.add_request(ids, params(i), request_id=f"r{i}")
            results[f"r{i}"] = ([], "", None)
        for chunk in engine.step():
            ids, text, _ = results[chunk.request_id]
            results[chunk.request_id] = (ids + chunk.new_token_ids, text + chunk.new_text, chunk.finish_reason)
    return results


def chi2_homogeneity_p(a: collections.Counter, b: collections.Counter, min_expected: float = 5.0) -> float:
    """p-value that two samples' counts come from one distribution (Pearson's chi-square, cells expected below
    min_expected in either sample pooled into one)."""
    na, nb = sum(a.values()), sum(b.values())
    big, rest = [], [0, 0]
    for key in set(a) | set(b):
        pooled = (a[key] + b[key]) / (na + nb)
        if min(pooled * na, pooled * nb) >= min_expected:
            big.append((a[key], b[key]))
        else:
            rest[0], rest[1] = rest[0] + a[key], rest[1] + b[key]
    cells = big + ([tuple(rest)] if sum(rest) else [])
    stat = 0.0
    for ca, cb in cells:
        pooled = (ca + cb) / (na + nb)
        stat += (ca - pooled * na) ** 2 / (pooled * na) + (cb - pooled * nb) ** 2 / (pooled * nb)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def assert_sampled_like_without(llm_spec: LLM, llm_plain: LLM) -> None:
    """Speculative sampling on the real model: a prompt a drafter continues ("a b c d e" repeated), three tokens drawn
    at temperature 1.5 from the top 3 (a small vocabulary), 400 requests with drafts against 400 without. The first
    token and the three together are distributed alike (chi-square, p > 0.001; the engines' seeds are fixed, so a
    run repeats its result), and drafts were both accepted and rejected on the way."""
    ids = llm_spec.tokenizer.encode("a b c d e a b c d e a b c d e a b c", add_special_tokens=False)
    params = SamplingParams(max_tokens=3, temperature=1.5, top_k=3, ignore_eos=True)
    stats = llm_spec.engine.scheduler
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    # batches of 16, the fixture's spec_max_batch: every step may draft
    with_drafts = [tuple(o.token_ids) for _ in range(25) for o in llm_spec.generate([ids] * 16, params)]
    drafted, accepted = stats.num_draft_tokens - drafted, stats.num_accepted_tokens - accepted
    assert 0 < accepted < drafted, (drafted, accepted)
    without = [tuple(o.token_ids) for _ in range(25) for o in llm_plain.generate([ids] * 16, params)]
    assert chi2_homogeneity_p(collections.Counter(t[0] for t in with_drafts),
                              collections.Counter(t[0] for t in without)) > 1e-3
    assert chi2_homogeneity_p(collections.Counter(with_drafts), collections.Counter(without)) > 1e-3
