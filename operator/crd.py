"""The LLMService CustomResourceDefinition, built from the pydantic spec (spec.py) so the two never drift.

`python -m cpuserve.operator crd` prints it; charts/cpuserve/crds/llmservice.yaml is that output (a test
keeps them equal). Pydantic's JSON Schema becomes a structural OpenAPI v3 schema: $refs inlined, Optional
unwrapped, titles dropped, exclusive bounds in OpenAPI 3.0 form.
"""
from __future__ import annotations

from typing import Any

from pydantic.alias_generators import to_camel

from cpuserve.engine.config import engine_option
from cpuserve.operator.spec import SERVE_FIELDS_FROM_SPEC, LLMServiceSpec
from cpuserve.serving.serve_options import SERVE_OPTION_HELP, described

GROUP = "cpuserve.dev"
VERSION = "v1alpha1"
KIND = "LLMService"
PLURAL = "llmservices"
API_VERSION = f"{GROUP}/{VERSION}"

_CONDITION = {
    "type": "object",
    "required": ["type", "status"],
    "properties": {
        "type": {"type": "string", "enum": ["Ready", "Progressing", "Degraded", "ValidationFailed"]},
        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "reason": {"type": "string"},
        "message": {"type": "string"},
        "observedGeneration": {"type": "integer", "format": "int64"},
        "lastTransitionTime": {"type": "string", "format": "date-time"},
    },
}
STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "Observed state, written by the operator.",
    "properties": {
        "observedGeneration": {"type": "integer", "format": "int64"},
        "conditions": {"type": "array", "items": _CONDITION, "x-kubernetes-list-type": "map",
                       "x-kubernetes-list-map-keys": ["type"]},
        "replicas": {"type": "integer", "description": "Desired replica groups (scale subresource)."},
        "readyReplicas": {"type": "integer", "description": "Replica groups whose every rank is ready."},
        "selector": {"type": "string", "description": "Label selector of the rank pods (scale subresource)."},
        "model": {"type": "string", "description": "Served model name."},
        "memoryPerRank": {"type": "string", "description": "Memory request and limit of each rank pod."},
        "memoryArithmetic": {"type": "string", "description": "How memoryPerRank was computed."},
        "endpoints": {"type": "object", "additionalProperties": {"type": "string"},
                      "description": "gRPC, HTTP and metrics addresses inside the cluster."},
    },
}
PRINTER_COLUMNS = [
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
    {"name": "Available", "type": "integer", "jsonPath": ".status.readyReplicas", "priority": 1},
    {"name": "Model", "type": "string", "jsonPath": ".status.model"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]
_DROP = {"title", "$defs"}


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """Rewrite one pydantic JSON Schema node into a Kubernetes structural schema node."""
    if isinstance(node, list):
        return [_structural(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs)
    if "anyOf" in node:  # Optional[X] = anyOf[X, null]: keep X, the field is simply optional
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        assert len(branches) == 1, f"unsupported union in the spec schema: {node}"
        rest = {k: v for k, v in node.items() if k not in ("anyOf", "default")}
        return _structural({**branches[0], **rest}, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP or (key == "default" and value is None):
            continue
        if key == "additionalProperties" and value is False:  # not structural; the API server prunes instead
            continue
        if key in ("exclusiveMinimum", "exclusiveMaximum"):  # JSON Schema 2020 -> OpenAPI 3.0
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "properties":
            out[key] = {name: _structural(sub, defs) for name, sub in value.items()}
        else:
            out[key] = _structural(value, defs)
    if "description" in out:
        out["description"] = " ".join(out["description"].split())
    return out


def option_help(serve_name: str) -> str:
    """The help of the `cpuserve serve` option `serve_name`: serve_options.py's, or else EngineConfig's."""
    return SERVE_OPTION_HELP.get(serve_name) or engine_option(serve_name)[1]


def _with_option_help(schema: dict[str, Any]) -> None:
    """Each field that sets a `cpuserve serve` option describes it with that option's help first, then with its own
    docstring (what holds on Kubernetes), so the two never tell different stories."""
    for serve_name, path in SERVE_FIELDS_FROM_SPEC.items():
        node = schema
        for name in path.split("."):
            node = node["properties"][to_camel(name)]
        node["description"] = described(option_help(serve_name), node.get("description", ""))


def spec_schema() -> dict[str, Any]:
    """The OpenAPI v3 schema of .spec."""
    raw = LLMServiceSpec.model_json_schema(by_alias=True)
    schema = _structural(raw, raw.get("$defs", {}))
    schema["description"] = "Desired state of a served model."
    _with_option_help(schema)
    return schema


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition manifest."""
    schema = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": STATUS_SCHEMA,
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}", "labels": {"app.kubernetes.io/name": "cpuserve"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": "llmservice",
                      "shortNames": ["llms"], "categories": ["cpuserve"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": schema},
                "subresources": {"status": {}, "scale": {
                    "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                    "labelSelectorPath": ".status.selector"}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
            }],
        },
    }
