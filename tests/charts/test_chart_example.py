"""The example LLMService (SmolLM2) passes the CRD schema and the operator's checks, and what the operator
would make of it is valid Kubernetes."""
from __future__ import annotations

import jsonschema
import kubernetes_validate
import yaml

from chart_tools import CHART, K8S_VERSION
from cpuserve.operator.children import build_children
from cpuserve.operator.crd import build_crd
from cpuserve.operator.serve_document import build_serve_document
from cpuserve.operator.settings import OperatorSettings
from cpuserve.operator.validation import validate


def example() -> dict:
    return yaml.safe_load((CHART / "examples" / "llmservice-smollm2.yaml").read_text())


def test_example_passes_the_crd_schema():
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.Draft4Validator(schema).validate(example())


def test_example_reconciles_to_valid_manifests():
    body = example()
    body["metadata"].update(namespace="default", uid="0000-example", generation=1)
    spec, findings = validate(body, OperatorSettings())
    assert findings == []
    manifests = build_children(body, spec, OperatorSettings(), with_service_monitor=False)
    for manifest in manifests:
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    assert [m["metadata"]["name"] for m in manifests if m["kind"] == "Pod"] == ["smollm2-head", "smollm2-g0-r0"]
    args = build_serve_document(spec)["applications"][0]["args"]  # applied to the head through Serve's REST API
    assert "model" not in args and args["weights"] == "int4"
