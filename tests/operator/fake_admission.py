"""What the fake API server does to an object before it stores it, as a real kube-apiserver does (measured
against Kubernetes 1.36, see DESIGN.md): unknown fields pruned (or refused under fieldValidation=Strict), a
CRD's schema defaults applied, a CRD's schema enforced (its x-kubernetes-validations CEL rules too, evaluated by
cel-python), a pod refused while its service account does not exist.

Built-in kinds use the OpenAPI schemas that kubernetes-validate ships; a CRD kind uses its openAPIV3Schema.
"""
from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate

K8S_VERSION = "1.36.0"
SCHEMAS = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{K8S_VERSION}-local"


class Refused(Exception):
    """A request the API server refuses: carries the Status object it answers with."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                       "message": message, "reason": reason, "details": details or {}, "code": code}


@functools.cache
def _definitions() -> dict[str, Any]:
    return json.loads((SCHEMAS / "_definitions.json").read_text())["$defs"]


@functools.cache
def builtin_schema(kind: str, group: str, version: str) -> dict[str, Any]:
    """The OpenAPI schema of a built-in kind (e.g. pod-v1.json, networkpolicy-networking-v1.json)."""
    name = "-".join(filter(None, (kind.lower(), group.split(".")[0], version))) + ".json"
    return json.loads((SCHEMAS / name).read_text())


def _resolve(schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = _definitions()[schema["$ref"].rsplit("/", 1)[-1]]
    if "allOf" in schema and len(schema["allOf"]) == 1:
        return _resolve({**schema["allOf"][0], **{k: v for k, v in schema.items() if k != "allOf"}})
    return schema


def prune(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Drop the fields `schema` does not declare from `obj` (in place); returns their paths ("spec.foo")."""
    schema = _resolve(schema)
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    unknown: list[str] = []
    if isinstance(obj, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for key in list(obj):
            sub = f"{path}.{key}" if path else key
            if props is not None and key in props:
                unknown += prune(obj[key], props[key], sub)
            elif isinstance(extra, dict):
                unknown += prune(obj[key], extra, sub)
            elif props is not None:
                unknown.append(sub)
                del obj[key]
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            unknown += prune(item, schema["items"], f"{path}[{i}]")
    return unknown


def apply_defaults(obj: Any, schema: dict[str, Any]) -> None:
    """Structural defaulting (in place): a declared default fills an absent field of a present object."""
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                apply_defaults(obj[key], sub)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            apply_defaults(item, schema["items"])


def admit(obj: dict[str, Any], kind: Any, query: dict[str, str]) -> list[str]:
    """Prune or refuse unknown fields, default and validate a CRD object; returns the Warning header values.

    Raises:
        Refused: 400 BadRequest for an unknown field under fieldValidation=Strict, 422 Invalid for a value the
        CRD's schema refuses.
    """
    schema = kind.schema if kind.schema is not None else (
        builtin_schema(kind.kind, kind.group, kind.version) if kind.builtin else None)
    if schema is None:
        return []
    unknown = prune(obj, schema)
    mode = query.get("fieldValidation", "Warn")
    if unknown and mode == "Strict":
        prefix = "" if kind.schema is not None else \
            f'{kind.kind} in version "{kind.version}" cannot be handled as a {kind.kind}: '
        raise Refused(400, "BadRequest", prefix + "strict decoding error: " +
                      ", ".join(f'unknown field "{u}"' for u in unknown))
    if kind.schema is not None:
        apply_defaults(obj, kind.schema)
        errors = sorted(jsonschema.Draft4Validator(kind.schema).iter_errors(obj), key=lambda e: list(e.path))
        causes = [f"{'.'.join(str(p) for p in e.path)}: Invalid value: {e.message}" for e in errors]
        causes = causes or cel_failures(obj, kind.schema)  # the server runs the rules on a schema-valid object
        if causes:
            name = obj.get("metadata", {}).get("name", "")
            causes = "; ".join(causes)
            raise Refused(422, "Invalid", f'{kind.kind} "{name}" is invalid: {causes}',
                          {"name": name, "group": kind.group, "kind": kind.kind})
    return [f'299 - "unknown field \\"{u}\\""' for u in unknown] if mode == "Warn" else []


@functools.cache
def _cel_program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_failures(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """The x-kubernetes-validations rules `obj` breaks, as the API server words them: `<path><fieldPath>: Invalid
    value: "object": <message>` (each rule with `self` bound to the object at its node)."""
    out: list[str] = []
    if isinstance(obj, dict):
        for rule in schema.get("x-kubernetes-validations") or []:
            if not _cel_program(rule["rule"]).evaluate({"self": celpy.json_to_cel(obj)}):
                out.append(f'{path}{rule.get("fieldPath", "")}: Invalid value: "object": '
                           f'{rule.get("message") or "failed rule: " + rule["rule"]}')
        for key, sub in (schema.get("properties") or {}).items():
            if key in obj:
                out += cel_failures(obj[key], sub, f"{path}.{key}" if path else key)
    return out


def check_service_account(pod: dict[str, Any], ns: str, exists) -> None:
    """The ServiceAccount admission plugin: a pod's service account must exist before the pod."""
    sa = (pod.get("spec") or {}).get("serviceAccountName") or "default"
    if not exists(sa):
        name = pod.get("metadata", {}).get("name", "")
        raise Refused(403, "Forbidden", f'pods "{name}" is forbidden: error looking up service account '
                      f'{ns}/{sa}: serviceaccount "{sa}" not found', {"name": name, "kind": "pods"})


def load_crd_kind(crd: dict[str, Any], kind_cls) -> Any:
    """The Kind a CustomResourceDefinition registers (its storage version's schema and subresources)."""
    spec = crd["spec"]
    version = next(v for v in spec["versions"] if v.get("storage"))
    sub = version.get("subresources") or {}
    return kind_cls(spec["group"], version["name"], spec["names"]["plural"], spec["names"]["kind"],
                    spec["scope"] == "Namespaced", "status" in sub, builtin=False,
                    schema=version["schema"]["openAPIV3Schema"], scale=sub.get("scale"))
