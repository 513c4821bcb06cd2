"""Specs that pass the schema but are inconsistent: each finding names the field, the value, what is right."""
from __future__ import annotations

import pytest

from cpuserve.operator.conditions import Observed, build_status
from cpuserve.operator.settings import OperatorSettings
from cpuserve.operator.validation import validate
from llmservice_factory import make_body

SETTINGS = OperatorSettings(max_ranks_per_replica=4)
BIG = {"source": "pvc", "claimName": "m", "path": "m.gguf", "numParameters": 7_000_000_000}
DRAFT = {"path": "draft/d.gguf", "numParameters": 360_000_000}

# what the engine refuses (engine/config.py _check_speculative) and where a draft may be: one row each
SPECULATIVE_CASES = [  # (name, spec, field, words in the message)
    ("chat", {"speculative": {"method": "ngram", "draft": {"weights": "int8"}}}, "spec.speculative.draft",
     ["method draft's (it is ngram)", "set spec.speculative.method draft", "or remove spec.speculative.draft"]),
    ("chat", {"speculative": {"method": "draft", "draft": DRAFT}}, "spec.speculative.draft.path",
     ["'draft/d.gguf'", "needs spec.model.source pvc (it is embedded)", "omit the path", "embedded SmolLM2"]),
    ("chat", {"model": {"source": "url", "url": "https://h/m.gguf", "numParameters": 10**9},
              "speculative": {"method": "draft", "draft": DRAFT}}, "spec.speculative.draft.path", ["(it is url)"]),
    ("chat", {"model": BIG, "speculative": {"method": "draft", "draft": {"path": "d.gguf"}}},
     "spec.speculative.draft.numParameters", ["required when spec.speculative.draft.path is set", "rank-0 pods"]),
    ("chat", {"batching": {"maxNumSeqs": 16, "maxNumBatchedTokens": 16},
              "speculative": {"method": "ngram", "tokens": 16}},
     "spec.speculative.tokens", ["=16", "below spec.batching.maxNumBatchedTokens (16)"]),
    ("chat", {"model": BIG, "resources": {"kvCacheGb": 1, "memoryPerRankGb": 7.5},
              "speculative": {"method": "draft", "draft": {**DRAFT, "kvCacheGb": 2}}},
     "spec.resources.kvCacheGb", ["does not fit", "+ draft 0.251 GiB (360000000 params x 0.75 B int4/g32) + draft KV "
                                  "2.000 GiB", "memoryPerRankGb=7.5"]),
]
CASES = [  # (name, spec, field, words in the message)
    ("chat", {"resources": {"kvCacheGb": 20, "memoryPerRankGb": 8}}, "spec.resources.kvCacheGb",
     ["does not fit", "memoryPerRankGb=8"]),
    ("chat", {"ranksPerReplica": 6}, "spec.ranksPerReplica", ["at most 4 sockets"]),
    ("chat", {"ranksPerReplica": 3, "placement": {"mode": "pack", "socketsPerNode": 2}}, "spec.ranksPerReplica",
     ["one node of 2 sockets"]),
    ("chat", {"model": {**BIG, "format": "safetensors", "checkpointType": "Q4_1"}}, "spec.model.checkpointType",
     ["not a safetensors type", "F32, F16, BF16"]),
    ("chat", {"model": {"source": "embedded", "format": "safetensors"}}, "spec.model.format", ["embedded model is gguf"]),
    ("chat", {"model": {"source": "pvc", "path": "m.gguf", "numParameters": 10**9}}, "spec.model.claimName",
     ["required when spec.model.source is pvc"]),
    ("chat", {"model": {"source": "url", "url": "https://h/m.gguf"}}, "spec.model.numParameters", ["required"]),
    ("chat", {"model": {"source": "url", "url": "https://h/m.safetensors", "format": "safetensors",
                        "numParameters": 10**9}}, "spec.model.url", [".tar"]),
    ("chat", {"model": {"source": "url", "numParameters": 10**9}}, "spec.model.url", ["required"]),
    ("chat", {"ports": {"grpc": 8000, "http": 8000}}, "spec.ports", ["distinct"]),
    ("chat", {"ports": {"metrics": 6379}}, "spec.ports", ["6379"]),
    ("chat", {"ports": {"engineMetrics": 8080}}, "spec.ports", ["4 distinct", "'engineMetrics': 8080"]),
    ("chat", {"batching": {"maxNumSeqs": 64, "maxNumBatchedTokens": 32}}, "spec.batching.maxNumBatchedTokens",
     ["at least spec.batching.maxNumSeqs (64)"]),
    ("chat", {"quantization": {"activations": "int8-token"}}, "spec.quantization.activations",
     ["per-channel weights", "spec.quantization.weights int8 (it is int4)"]),
    ("chat", {"quantization": {"weights": "bf16", "activations": "int8-token"}}, "spec.quantization.activations",
     ["(it is bf16)"]),
    ("9chat", {}, "metadata.name", ["DNS-1035"]),
    *SPECULATIVE_CASES,
    ("c" * 41, {}, "metadata.name", ["at most 40"]),
]


@pytest.mark.parametrize("name,spec,field,words", CASES, ids=[c[2] + str(i) for i, c in enumerate(CASES)])
def test_inconsistent_spec_names_the_field(name, spec, field, words):
    _, findings = validate(make_body(name=name, **spec), SETTINGS)
    assert [f.field for f in findings] == [field]
    text = str(findings[0])
    assert text.startswith(field + "=")
    for word in words:
        assert word in text


def test_schema_errors_are_findings_too():
    """A stale CRD may let a bad type through; pydantic still names the field."""
    spec, findings = validate(make_body(replicas="many"), SETTINGS)
    assert spec is None and [f.field for f in findings] == ["spec.replicas"] and findings[0].value == "many"


@pytest.mark.parametrize("name,spec,field,words", SPECULATIVE_CASES, ids=[c[2] for c in SPECULATIVE_CASES])
def test_speculative_findings_are_the_validation_failed_condition(name, spec, field, words):
    body = make_body(name=name, **spec)
    _, findings = validate(body, SETTINGS)
    status = build_status(body, None, None, Observed(), findings, "2025-01-01T00:00:00Z")
    (cond,) = [c for c in status["conditions"] if c["type"] == "ValidationFailed"]
    assert (cond["status"], cond["reason"]) == ("True", "InvalidSpec")
    assert cond["message"].startswith(field + "=") and all(word in cond["message"] for word in words)


@pytest.mark.parametrize("spec", [
    {},
    {"model": BIG, "ranksPerReplica": 4, "resources": {"kvCacheGb": 8, "memoryPerRankGb": 12}},
    {"speculative": {"method": "ngram", "tokens": 8, "maxBatch": 16}, "batching": {"arrivalWindowMs": 0}},
    {"speculative": {"method": "draft"}},  # the embedded SmolLM2 drafts, as the engine's default
    {"model": BIG, "speculative": {"method": "draft", "draft": {"weights": "int8"}}},  # embedded draft, pvc model
    {"model": BIG, "ranksPerReplica": 2, "speculative": {"method": "draft", "draft": {**DRAFT, "kvCacheGb": 1}}},
    {"ranksPerReplica": 2, "placement": {"mode": "pack", "socketsPerNode": 2}},
    {"quantization": {"weights": "int8", "activations": "int8-token"}},
])
def test_consistent_specs_have_no_findings(spec):
    parsed, findings = validate(make_body(**spec), SETTINGS)
    assert findings == [] and parsed is not None
