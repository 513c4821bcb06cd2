"""Names, labels and the spec hash of every child of an LLMService."""
from __future__ import annotations

import hashlib
import json
from typing import Any

from cpuserve.operator.crd import GROUP
from cpuserve.serving.names import RANK_LABEL

LABEL_SERVICE = f"{GROUP}/llmservice"
LABEL_GROUP = f"{GROUP}/group"
LABEL_RANK = RANK_LABEL  # also its Ray node's label: serving places a group's engine by it
LABEL_REVISION = f"{GROUP}/revision"  # a rank pod's revision, on the pod and on its Ray node
LABEL_COMPONENT = "app.kubernetes.io/component"
ANNOTATION_HASH = f"{GROUP}/spec-hash"
MAX_NAME_LENGTH = 40
"""Longest LLMService name whose children's names ("-g255-r63", "-headless") stay DNS labels (63)."""
SOCKET_RESOURCE = "cpuserve_socket"
RAY_GCS_PORT = 6379


def base_labels(name: str) -> dict[str, str]:
    """Labels every child of the LLMService `name` carries; the operator lists children by them."""
    return {
        "app.kubernetes.io/name": "cpuserve",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": "cpuserve-operator",
        LABEL_SERVICE: name,
    }


def head_name(name: str) -> str:
    return f"{name}-head"


def rank_name(name: str, group: int, rank: int) -> str:
    return f"{name}-g{group}-r{rank}"


def headless_name(name: str) -> str:
    return f"{name}-headless"


def metrics_name(name: str) -> str:
    return f"{name}-metrics"


def engine_metrics_name(name: str) -> str:
    return f"{name}-engine-metrics"


def rank_selector(name: str) -> str:
    """Label selector string of the rank pods (the scale subresource's)."""
    return f"{LABEL_SERVICE}={name},{LABEL_COMPONENT}=rank"


def spec_hash(manifest: dict[str, Any]) -> str:
    """Stable hash of a manifest (key order does not matter); the hash annotation itself is excluded."""
    clean = json.loads(json.dumps(manifest))
    meta = clean.get("metadata", {})
    meta.get("annotations", {}).pop(ANNOTATION_HASH, None)
    if meta.get("annotations") == {}:
        del meta["annotations"]
    return hashlib.sha256(json.dumps(clean, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def finish(manifest: dict[str, Any], owner: dict[str, Any]) -> dict[str, Any]:
    """Add the owner reference and the spec-hash annotation to a child manifest (returns it)."""
    meta = manifest["metadata"]
    meta["namespace"] = owner["metadata"]["namespace"]
    meta["ownerReferences"] = [{
        "apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True,
    }]
    meta.setdefault("annotations", {})[ANNOTATION_HASH] = spec_hash(manifest)
    return manifest
