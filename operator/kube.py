"""A small generic Kubernetes REST client over the official client's configuration and auth.

Only the kinds the operator manages, each by a fixed path (no discovery round-trips), as plain dicts.
"""
from __future__ import annotations

import json
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from cpuserve.operator.crd import API_VERSION, PLURAL

PATHS = {  # kind -> (API prefix, plural)
    "Pod": ("/api/v1", "pods"),
    "Service": ("/api/v1", "services"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Secret": ("/api/v1", "secrets"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "ServiceMonitor": ("/apis/monitoring.coreos.com/v1", "servicemonitors"),
    "LLMService": (f"/apis/{API_VERSION}", PLURAL),
}
TIMEOUT = (5, 30)
# Writes ask for strict field validation: a field the API server does not know is refused, never silently
# dropped (its default prunes unknown fields with only a warning header).
STRICT = [("fieldValidation", "Strict")]


class KubeError(Exception):
    """A Kubernetes API call failed: `status` is the HTTP status (0 when there was no response); `reason` and
    `message` are the API's own (its Status object's, e.g. "Forbidden"), or the HTTP reason phrase."""

    def __init__(self, status: int, message: str, reason: str = ""):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.reason = reason or ("NoResponse" if status == 0 else f"HTTP{status}")
        self.message = message

    @classmethod
    def from_response(cls, status: int, body: bytes | str | None, fallback: str) -> KubeError:
        """From an error response: its Status object's reason and message when the body is one."""
        text = body.decode(errors="replace") if isinstance(body, bytes) else (body or "")
        try:
            doc = json.loads(text)
        except ValueError:
            doc = None
        if isinstance(doc, dict) and doc.get("kind") == "Status":
            return cls(status, str(doc.get("message") or fallback), str(doc.get("reason") or ""))
        return cls(status, text[:500] or fallback)


class Kube:
    """Plain-dict CRUD for the kinds in PATHS."""

    def __init__(self, api: client.ApiClient):
        self.api = api

    @classmethod
    def from_environment(cls) -> Kube:
        """In-cluster service account if present, else the kubeconfig (KUBECONFIG or ~/.kube/config)."""
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return cls(client.ApiClient())

    def _call(self, method: str, path: str, body: Any = None, query: list[tuple[str, str]] | None = None,
              content_type: str = "application/json") -> dict[str, Any]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        req = self.api.param_serialize(method, path, query_params=query or [], header_params=headers,
                                       body=body, auth_settings=["BearerToken"])
        try:
            rsp = self.api.call_api(*req, _request_timeout=TIMEOUT)
        except ApiException as err:
            raise KubeError.from_response(err.status or 0, err.body, str(err.reason)) from err
        data = rsp.read()
        if rsp.status >= 400:
            raise KubeError.from_response(rsp.status, data, str(rsp.reason))
        return json.loads(data) if data else {}

    @staticmethod
    def path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        prefix, plural = PATHS[kind]
        out = f"{prefix}/namespaces/{namespace}/{plural}"
        return out + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", self.path(kind, namespace, name))
        except KubeError as err:
            if err.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        return self._call("GET", self.path(kind, namespace), query=[("labelSelector", selector)]).get("items", [])

    def create(self, manifest: dict[str, Any]) -> dict[str, Any] | None:
        """Create; None when it already exists (another pass got there first)."""
        meta = manifest["metadata"]
        try:
            return self._call("POST", self.path(manifest["kind"], meta["namespace"]), body=manifest, query=STRICT)
        except KubeError as err:
            if err.status == 409:
                return None
            raise

    def merge_patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any], sub: str | None = None) -> dict[str, Any]:
        return self._call("PATCH", self.path(kind, namespace, name, sub), body=patch, query=STRICT,
                          content_type="application/merge-patch+json")

    def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            self._call("DELETE", self.path(kind, namespace, name), body={"propagationPolicy": "Background"})
        except KubeError as err:
            if err.status != 404:
                raise

    def has_api(self, group_version: str) -> bool:
        """Whether the cluster serves an API group version (discovery; needs no extra RBAC)."""
        try:
            self._call("GET", f"/apis/{group_version}")
            return True
        except KubeError as err:
            if err.status == 404:
                return False
            raise
