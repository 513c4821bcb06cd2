"""The CRD's OpenAPI schema rejects bad specs (as the API server would) and accepts what pydantic accepts."""
from __future__ import annotations

import pytest
import kubernetes_validate
import yaml
from pathlib import Path

from cpuserve.operator.crd import build_crd
from cpuserve.operator.spec import LLMServiceSpec
from llmservice_factory import K8S_VERSION, crd_validator, make_raw_body

ROOT = Path(__file__).resolve().parents[2]

BAD_SPECS = [  # (spec, path of the offending field as jsonschema reports it)
    ({"replicas": 1}, "model"),                                       # model is required
    ({"model": {"source": "s3"}}, "source"),                          # enum
    ({"model": {"source": "embedded", "format": "onnx"}}, "format"),
    ({"model": {"source": "embedded"}, "quantization": {"weights": "int3"}}, "weights"),
    ({"model": {"source": "embedded"}, "quantization": {"groupSize": 64}}, "groupSize"),
    ({"model": {"source": "embedded"}, "quantization": {"kvCache": "fp8"}}, "kvCache"),
    ({"model": {"source": "embedded"}, "quantization": {"activations": "int4"}}, "activations"),
    ({"model": {"source": "embedded"}, "replicas": -1}, "replicas"),  # range
    ({"model": {"source": "embedded"}, "replicas": "two"}, "replicas"),  # type
    ({"model": {"source": "embedded"}, "ranksPerReplica": 0}, "ranksPerReplica"),
    ({"model": {"source": "embedded"}, "resources": {"cpusPerRank": 1.5}}, "cpusPerRank"),
    ({"model": {"source": "embedded"}, "resources": {"kvCacheGb": 0}}, "kvCacheGb"),  # exclusive minimum
    ({"model": {"source": "embedded"}, "ports": {"http": 80}}, "http"),
    ({"model": {"source": "url", "url": "ftp://host/m.gguf"}}, "url"),
    ({"model": {"source": "url", "url": "https://h/m", "sha256": "xyz"}}, "sha256"),
    ({"model": {"source": "pvc", "claimName": "Bad_Name"}}, "claimName"),
    ({"model": {"source": "embedded"}, "security": {"apiKeys": {"key": "k"}}}, "name"),  # required in apiKeys
    ({"model": {"source": "embedded"}, "placement": {"mode": "scatter"}}, "mode"),
    ({"model": {"source": "embedded"}, "batching": {"maxNumSeqs": 0}}, "maxNumSeqs"),
    ({"model": {"source": "embedded"}, "batching": {"maxQueuedTokens": 0}}, "maxQueuedTokens"),
    ({"model": {"source": "embedded"}, "drainTimeoutSeconds": -1}, "drainTimeoutSeconds"),
    ({"model": {"source": "embedded"}, "gpus": 1}, "spec"),           # unknown field
    ({"model": {"source": "embedded"}, "batching": {"arrivalWindowMs": 1001}}, "arrivalWindowMs"),
    ({"model": {"source": "embedded"}, "batching": {"arrivalWindowMs": -1}}, "arrivalWindowMs"),
    ({"model": {"source": "embedded"}, "speculative": {"tokens": 4}}, "method"),  # method is required
    ({"model": {"source": "embedded"}, "speculative": {"method": "eagle"}}, "method"),
    ({"model": {"source": "embedded"}, "speculative": {"method": "ngram", "tokens": 0}}, "tokens"),
    ({"model": {"source": "embedded"}, "speculative": {"method": "ngram", "maxBatch": 0}}, "maxBatch"),
    ({"model": {"source": "embedded"}, "speculative": {"method": "ngram", "ngramMax": 3}}, "speculative"),
    ({"model": {"source": "embedded"}, "speculative": {"method": "draft", "draft": {"path": "/abs/d.gguf"}}}, "path"),
    ({"model": {"source": "embedded"}, "speculative": {"method": "draft", "draft": {"weights": "int3"}}}, "weights"),
    ({"model": {"source": "embedded"}, "speculative": {"method": "draft", "draft": {"kvCacheGb": 0}}}, "kvCacheGb"),
    ({"model": {"source": "embedded"}, "speculative": {"method": "draft", "draft": {"numParameters": 10}}},
     "numParameters"),
]


@pytest.mark.parametrize("spec,field", BAD_SPECS, ids=[str(i) for i in range(len(BAD_SPECS))])
def test_schema_rejects_bad_spec_and_pydantic_agrees(spec, field):
    errors = list(crd_validator().iter_errors(make_raw_body(spec)))
    assert errors, f"schema accepted {spec}"
    where = " ".join(str(p) for e in errors for p in e.absolute_path) + " " + " ".join(e.message for e in errors)
    assert field in where, where
    with pytest.raises(ValueError):
        LLMServiceSpec.model_validate(spec)


GOOD_SPECS = [
    {"model": {"source": "embedded"}},
    {"model": {"source": "pvc", "claimName": "models", "path": "llama/7b.gguf", "numParameters": 6_738_415_616,
               "checkpointType": "Q4_0"}, "replicas": 3, "ranksPerReplica": 2,
     "quantization": {"weights": "int8", "activations": "int8-token", "kvCache": "bf16"},
     "placement": {"mode": "pack", "nodeSelector": {"a": "b"}}},
    {"model": {"source": "url", "url": "https://example.invalid/m.tar.gz", "format": "safetensors",
               "numParameters": 1_000_000_000}, "resources": {"kvCacheGb": 0.5, "memoryPerRankGb": 16},
     "security": {"tlsSecretName": "tls", "apiKeys": {"name": "keys"}, "rayAuthTokenSecret": "ray"}},
    {"model": {"source": "embedded"}, "batching": {"arrivalWindowMs": 5.5}, "speculative": {"method": "ngram"}},
    {"model": {"source": "pvc", "claimName": "models", "path": "llama/8b.gguf", "numParameters": 8_030_261_248},
     "speculative": {"method": "draft", "tokens": 6, "maxBatch": 2,
                     "draft": {"path": "llama/1b.gguf", "numParameters": 1_235_814_400, "weights": "int8",
                               "kvCacheGb": 0.5}}},
]


@pytest.mark.parametrize("spec", GOOD_SPECS)
def test_schema_accepts_good_spec(spec):
    assert not list(crd_validator().iter_errors(make_raw_body(spec)))
    assert LLMServiceSpec.model_validate(spec).model_dump(by_alias=True, exclude_unset=True) == spec


def test_crd_is_valid_kubernetes_with_subresources_and_columns():
    crd = build_crd()
    kubernetes_validate.validate(crd, K8S_VERSION, strict=True)
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    assert "status" in version["subresources"]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Ready", "Replicas", "Available", "Model", "Age"]


def test_crd_schema_is_structural():
    """No $ref, anyOf, title or additionalProperties: false anywhere (the API server refuses them)."""
    text = yaml.safe_dump(build_crd())
    for word in ("$ref", "anyOf", "title:", "additionalProperties: false", "exclusiveMinimum: 0"):
        assert word not in text, word


def test_chart_crd_is_the_generated_one():
    chart_crd = yaml.safe_load((ROOT / "charts/cpuserve/crds/llmservice.yaml").read_text())
    assert chart_crd == build_crd(), "regenerate: python -m cpuserve.operator crd > charts/cpuserve/crds/llmservice.yaml"


def test_every_schema_node_has_a_type():
    """Structural schema rule: each property, item and map value declares its type."""
    missing = []

    def walk(node, where):
        if "type" not in node:
            missing.append(where)
        for name, sub in (node.get("properties") or {}).items():
            walk(sub, f"{where}.{name}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{where}[]")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{where}{{}}")

    walk(build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"], "")
    assert missing == []


@pytest.mark.parametrize("quantization,refused", [
    ({"activations": "int8-token"}, True),  # the default weights are int4
    ({"weights": "int4", "activations": "int8-token"}, True),
    ({"weights": "fp32", "activations": "int8-token"}, True),
    ({"weights": "int8", "activations": "int8-token"}, False),
    ({"weights": "int4", "activations": "bf16"}, False),
    ({}, False),
])
def test_the_crds_cel_rule_refuses_token_scales_without_int8_weights(quantization, refused):
    """What the API server's CEL rule (x-kubernetes-validations) says, evaluated by cel-python as the fake API server
    does: the schema alone passes each of these; the rule names spec.quantization.activations."""
    from fake_admission import apply_defaults, cel_failures

    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    body = make_raw_body({"model": {"source": "embedded"}, "quantization": quantization})
    apply_defaults(body, schema)  # the server defaults before it validates
    assert not list(crd_validator().iter_errors(body))
    failures = cel_failures(body, schema)
    assert bool(failures) is refused, failures
    if refused:
        assert failures == ['spec.quantization.activations: Invalid value: "object": activations int8-token (one '
                            'scale per token) needs weights int8 (per-channel): set weights: int8, or activations: int8']
