"""Ray locked down: token auth in every pod from a per-LLMService Secret, and a NetworkPolicy that keeps Ray's
ports to the service's own pods (and the operator, for the Serve REST API) while clients reach only the
serving ports. Pure functions of the CR, like the other children.

    who -> which pods of LLMService "chat"          ports
    chat's own pods (head, ranks)                   all (GCS, raylets, object managers, workers, dashboard)
    the operator's pods                             dashboard 8265 (Serve REST API)
    anyone                                          gRPC, HTTP (head; rank-0 pods: their engine's), metrics,
                                                    engine metrics (rank pods)
"""
from __future__ import annotations

import base64
from typing import Any

from cpuserve.operator import naming
from cpuserve.operator.settings import OperatorSettings
from cpuserve.operator.spec import LLMServiceSpec

TOKEN_KEY = "token"
DASHBOARD_PORT = 8265
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server


def ray_token_secret_name(name: str, spec: LLMServiceSpec) -> str:
    """The Secret (key `token`) every pod reads RAY_AUTH_TOKEN from: the user's, else the generated one."""
    return spec.security.ray_auth_token_secret or f"{name}-ray-token"


def ray_auth_env(name: str, spec: LLMServiceSpec) -> list[dict[str, Any]]:
    """Ray token auth, on in every pod."""
    ref = {"name": ray_token_secret_name(name, spec), "key": TOKEN_KEY}
    return [{"name": "RAY_AUTH_MODE", "value": "token"},
            {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": ref}}]


def build_ray_token_secret(name: str, token: str) -> dict[str, Any]:
    """The generated token Secret. Created once and never patched: the token stays what the pods started with."""
    data = {TOKEN_KEY: base64.b64encode(token.encode()).decode()}
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "immutable": True,
            "metadata": {"name": f"{name}-ray-token", "labels": naming.base_labels(name)}, "data": data}


def _tcp(port: int) -> dict[str, Any]:
    return {"protocol": "TCP", "port": port}


def build_network_policy(name: str, spec: LLMServiceSpec, settings: OperatorSettings) -> dict[str, Any]:
    """Ingress to the LLMService's pods: see the module docstring. Egress is left open."""
    own = {"podSelector": {"matchLabels": {naming.LABEL_SERVICE: name}}}
    operator_peer: dict[str, Any] = {"podSelector": {"matchLabels": settings.operator_pod_labels()}}
    if settings.pod_namespace:
        operator_peer["namespaceSelector"] = {"matchLabels": {NAMESPACE_NAME_LABEL: settings.pod_namespace}}
    else:  # unknown (not set by the chart): the operator's labels in any namespace
        operator_peer["namespaceSelector"] = {}
    p = spec.ports
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": f"{name}-ray", "labels": naming.base_labels(name)},
        "spec": {
            "podSelector": {"matchLabels": {naming.LABEL_SERVICE: name}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [own]},
                {"from": [operator_peer], "ports": [_tcp(DASHBOARD_PORT)]},
                {"ports": [_tcp(p.grpc), _tcp(p.http), _tcp(p.metrics), _tcp(p.engine_metrics)]},
            ],
        },
    }
