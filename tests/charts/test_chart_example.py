"""The example LLMServices (SmolLM2 in the default scheme and in the throughput mode) pass the CRD schema, its CEL
rules and the operator's checks, and what the operator would make of them is valid Kubernetes."""
from __future__ import annotations

import jsonschema
import kubernetes_validate
import pytest
import yaml

from chart_tools import CHART, K8S_VERSION
from cpuserve.operator.children import build_children
from cpuserve.operator.crd import build_crd
from cpuserve.operator.serve_document import build_serve_document
from cpuserve.operator.settings import OperatorSettings
from cpuserve.serving.names import APP_NAME, ENGINE_APP_NAME
from cpuserve.operator.validation import validate


EXAMPLES = {  # file: (name, weights, activations)
    "llmservice-smollm2.yaml": ("smollm2", "int4", "int8"),
    "llmservice-smollm2-throughput.yaml": ("smollm2-throughput", "int8", "int8-token"),
}


def example(file: str) -> dict:
    return yaml.safe_load((CHART / "examples" / file).read_text())


def test_every_example_is_tested():
    assert sorted(p.name for p in (CHART / "examples").glob("*.yaml")) == sorted(EXAMPLES)


@pytest.mark.parametrize("file", EXAMPLES)
def test_example_passes_the_crd_schema(file):
    from fake_admission import cel_failures

    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.Draft4Validator(schema).validate(example(file))
    assert cel_failures(example(file), schema) == []


@pytest.mark.parametrize("file", EXAMPLES)
def test_example_reconciles_to_valid_manifests(file):
    name, weights, activations = EXAMPLES[file]
    body = example(file)
    body["metadata"].update(namespace="default", uid="0000-example", generation=1)
    spec, findings = validate(body, OperatorSettings())
    assert findings == []
    manifests = build_children(body, spec, OperatorSettings(), with_service_monitor=False)
    for manifest in manifests:
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    assert [m["metadata"]["name"] for m in manifests if m["kind"] == "Pod"] == [f"{name}-head", f"{name}-g0-r0"]
    apps = {a["name"]: a for a in build_serve_document(spec)["applications"]}  # applied through Serve's REST API
    args = apps[ENGINE_APP_NAME]["args"]  # the engine's application: the Ingress's never names weights
    assert "weights" not in apps[APP_NAME]["args"]
    assert "model" not in args and (args["weights"], args["activations"]) == (weights, activations)
