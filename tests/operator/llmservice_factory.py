"""Factories for LLMService bodies and a validator that applies the CRD schema as the API server would."""
from __future__ import annotations

import copy
from typing import Any

import jsonschema

from cpuserve.operator.crd import build_crd

K8S_VERSION = "1.34"


def make_body(name: str = "chat", namespace: str = "default", uid: str = "uid-1", generation: int = 1,
              **spec: Any) -> dict[str, Any]:
    """An LLMService as read from the API; spec defaults to the embedded model."""
    spec.setdefault("model", {"source": "embedded"})
    return make_raw_body(spec, name, namespace, uid, generation)


def make_raw_body(spec: dict[str, Any], name: str = "chat", namespace: str = "default", uid: str = "uid-1",
                  generation: int = 1) -> dict[str, Any]:
    """An LLMService with exactly `spec` (no defaults filled in)."""
    return {"apiVersion": "cpuserve.dev/v1alpha1", "kind": "LLMService",
            "metadata": {"name": name, "namespace": namespace, "uid": uid, "generation": generation},
            "spec": spec}


def _strict(node: Any) -> Any:
    """Close every object that lists properties: kubectl's strict field validation rejects unknown fields."""
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


def crd_validator() -> jsonschema.Validator:
    """Draft 4 (OpenAPI 3.0's dialect: boolean exclusiveMinimum) over the CRD's openAPIV3Schema."""
    schema = copy.deepcopy(build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft4Validator(_strict(schema))
