"""Structured outputs in the engine: per-request token masks inside the batched sampler step.

Outputs are checked with jsonschema and Python's re (independent of llguidance), never against the engine's own
figures; the model is the real SmolLM2.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from cpuserve.engine.errors import InvalidRequest
from cpuserve.engine.grammar import GrammarCompiler, StructuredOutput
from cpuserve.engine.sampler import apply_bitmask, mask_constrained, sample
from cpuserve.engine.sampling_params import SamplingParams

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}},
            "required": ["id", "tags"], "additionalProperties": False},
        "status": {"enum": ["active", "disabled", "pending"]}},
     "required": ["user", "status"], "additionalProperties": False},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -40, "maximum": 50},
                                      "unit": {"enum": ["C", "F"]},
                                      "ok": {"type": "boolean"}},
     "required": ["temperature", "unit", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                                                "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                                "required": ["sku", "qty"], "additionalProperties": False},
     "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["answer", "confidence"], "additionalProperties": False},
]


def structured(schema: dict) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema))


@pytest.fixture(scope="module")
def compiler(llm_int4) -> GrammarCompiler:
    return llm_int4.engine.grammars


def test_a_mask_allows_exactly_the_tokens_a_regex_can_continue_with(compiler, llm_int4):
    tok = llm_int4.tokenizer
    matcher = compiler.matcher(StructuredOutput("regex", "[0-9]{3}"))
    logits = torch.zeros(2, compiler.vocab_size)
    before = logits.clone()
    masked = mask_constrained(logits, [matcher, None])
    allowed = (masked[0] > float("-inf")).nonzero().flatten().tolist()
    texts = {t: tok.decode([t], skip_special_tokens=False) for t in allowed}
    # the reference: every token whose text is 1 to 3 digits, and nothing else
    digits = [t for t in range(tok.vocab_size) if re.fullmatch(r"[0-9]{1,3}", tok.decode([t], skip_special_tokens=False))]
    assert sorted(allowed) == sorted(digits), texts
    assert torch.equal(masked[1], before[1])  # the free row is untouched


def test_constrained_and_free_rows_share_one_batch(compiler):
    torch.manual_seed(0)
    logits = torch.randn(3, compiler.vocab_size)
    grammars = [None, compiler.matcher(StructuredOutput("regex", "yes|no")), None]
    out = sample(logits.clone(), [SamplingParams(temperature=0)] * 3, [None] * 3, [[]] * 3, [0] * 3, grammars)
    free = logits.argmax(-1).tolist()
    assert out.token_ids[0] == free[0] and out.token_ids[2] == free[2]
    masked = mask_constrained(logits.clone(), grammars)
    assert out.token_ids[1] == int(masked[1].argmax()) and masked[1, out.token_ids[1]] > float("-inf")


@pytest.mark.parametrize("vocab", [49152, 1000, 37])  # SmolLM2's, and sizes that leave a partial last word
def test_apply_bitmask_matches_unpacked_bits(vocab):
    """The branch-free apply against numpy's unpackbits + masked_fill (the plain reference), on random masks."""
    rng = np.random.default_rng(vocab)
    bitmask = torch.from_numpy(rng.integers(-2**31, 2**31, size=(3, (vocab + 31) // 32), dtype=np.int64)
                               .astype(np.int32))
    logits = torch.randn(5, vocab)
    rows = [0, 2, 3]
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, count=vocab, bitorder="little").astype(bool)
    expected = logits.clone()
    for k, i in enumerate(rows):
        expected[i].masked_fill_(torch.from_numpy(~allowed[k]), float("-inf"))
    apply_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    assert 0 < int(torch.isinf(logits).sum()) < 3 * vocab


def test_bad_specs_name_the_field():
    for kind, spec in [("json_schema", "{not json"), ("json_schema", '{"type": "foo"}'),
                       ("json_schema", '{"type": "string", "minLength": 5, "maxLength": 2}'), ("regex", "("),
                       ("grammar", "start: undefined_rule"), ("xml", ""),
                       # an integer past 64 bits: llguidance raised a TypeError ("sampling" named; found by fuzzing)
                       ("json_schema", '{"type": "integer", "maximum": 1180591620717411303424}')]:
        with pytest.raises(InvalidRequest) as e:
            SamplingParams(structured_output={"kind": kind, "spec": spec})
        assert e.value.param == "structured_output", (kind, spec)


def test_outputs_validate_against_many_schemas_in_one_batch_with_free_requests(llm_int4):
    tok = llm_int4.tokenizer
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Describe a customer record as JSON."}]), add_special_tokens=False)
    # greedy and sampled rows alternate; every number and string is bounded so that each can finish in max_tokens
    params = [SamplingParams(max_tokens=100, temperature=0.8 * (i % 2), seed=i, structured_output=structured(s))
              for i, s in enumerate(SCHEMAS)]
    params += [SamplingParams(max_tokens=24, temperature=0), SamplingParams(max_tokens=100, temperature=0,
                                                                            structured_output={"kind": "json_object"})]
    outs = llm_int4.generate([prompt] * len(params), params)
    for p, o in zip(params, outs):
        if p.structured_output is None:
            continue
        if p.structured_output.kind == "json_object":  # unbounded: it may run out of tokens, but never stops invalid
            assert o.text.startswith("{") and (o.finish_reason == "length" or isinstance(json.loads(o.text), dict))
            continue
        assert o.finish_reason == "stop", (p.structured_output, o.text)
        jsonschema.validate(json.loads(o.text), json.loads(p.structured_output.spec))
    # the free request in the same batch produced what it produces alone
    alone = llm_int4.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    assert outs[-2].token_ids == alone.token_ids


def test_a_schema_too_long_for_max_tokens_ends_with_length_never_invalid_json_with_stop(llm_int4):
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 500}
    out = llm_int4.generate(["Numbers:"], SamplingParams(max_tokens=12, temperature=0,
                                                        structured_output=structured(schema)))[0]
    assert out.finish_reason == "length"
    assert out.text.startswith("[")
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_regex_and_grammar_constrain_the_whole_output(llm_int4):
    outs = llm_int4.generate(["The year the first CPU shipped:", "Is a cache fast? Answer:"], [
        SamplingParams(max_tokens=10, temperature=0.7, seed=3, structured_output={"kind": "regex", "spec": "19[0-9]{2}"}),
        SamplingParams(max_tokens=10, temperature=0.7, seed=3,
                       structured_output={"kind": "grammar", "spec": 'root ::= "yes" | "no" | "maybe"'})])
    assert re.fullmatch(r"19[0-9]{2}", outs[0].text) and outs[0].finish_reason == "stop", outs[0].text
    assert outs[1].text in ("yes", "no", "maybe") and outs[1].finish_reason == "stop", outs[1].text
