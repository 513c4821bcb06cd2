"""Ray Serve's REST API on an LLMService's head (the dashboard port), as KubeRay's RayService uses it: the Serve
config is applied in place (PUT /api/serve/applications/) whenever what is deployed differs from the spec,
and the application's status is read back. Only pods whose own spec changed ever restart.
"""
from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from cpuserve.operator import naming
from cpuserve.operator.conditions import SERVE_FAILED, SERVE_RUNNING
from cpuserve.operator.kube import Kube
from cpuserve.operator.security import DASHBOARD_PORT, TOKEN_KEY, ray_token_secret_name
from cpuserve.operator.settings import OperatorSettings
from cpuserve.operator.spec import LLMServiceSpec

APPLICATIONS = "/api/serve/applications/"
TIMEOUT_SECONDS = 10.0
STATE_LIMIT = 10_000  # rows of a Ray state API listing (Ray's default is 100)


class ServeApiError(Exception):
    """The head's Serve REST API could not be reached or refused the config."""


@dataclass(frozen=True, slots=True)
class ServeState:
    """What the head said: the applications' status (RUNNING, DEPLOYING, DEPLOY_FAILED, ...) and message,
    whether this pass applied a new config, or why the API could not be used; which rank pods run actors."""

    status: str = ""
    message: str = ""
    applied: bool = False
    error: str = ""
    busy: frozenset[str] | None = None
    """Ray nodes (rank pods) that run an actor; None when unknown."""


class ServeApi:
    """The Serve REST API (and Ray's state API) of one Ray head, authenticated with the cluster's Ray token."""

    def __init__(self, base_url: str, token: str, timeout: float = TIMEOUT_SECONDS):
        self.base = base_url.rstrip("/")
        self.url = self.base + APPLICATIONS
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self.timeout = timeout

    def _call(self, method: str, body: Any = None, url: str | None = None) -> dict[str, Any]:
        url = url or self.url
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method, headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as rsp:  # noqa: S310 (http URL from settings)
                text = rsp.read()
        except urllib.error.HTTPError as err:
            raise ServeApiError(f"{method} {url}: HTTP {err.code}: {err.read()[:300].decode(errors='replace')}")
        except OSError as err:  # refused, unresolvable, timed out: the head is not up yet
            raise ServeApiError(f"{method} {url}: {err}") from err
        return json.loads(text) if text.strip() else {}

    def details(self) -> dict[str, Any]:
        return self._call("GET")

    def deploy(self, document: dict[str, Any]) -> None:
        self._call("PUT", document)

    def _state(self, query: str) -> list[dict[str, Any]]:
        """Rows of one Ray state API listing (the dashboard's /api/v0/...)."""
        return self._call("GET", url=f"{self.base}/api/v0/{query}")["data"]["result"]["result"]

    def busy_nodes(self) -> set[str]:
        """Names of the Ray nodes that run an actor (a rank pod's node is named after the pod: pods.build_rank_pod).

        Ray's own view, not Serve's: while Serve builds a new version of an application it lists none of its
        replicas, and a replica group's rank actors are no Serve replicas."""
        actors = self._state(f"actors?limit={STATE_LIMIT}&filter_keys=state&filter_predicates=%3D&filter_values=ALIVE")
        nodes = {a["node_id"] for a in actors if a.get("node_id")}
        return {n["node_name"] for n in self._state(f"nodes?limit={STATE_LIMIT}&detail=true") if n["node_id"] in nodes}


def is_deployed(details: dict[str, Any], document: dict[str, Any]) -> bool:
    """Whether the head already runs `document` (every application as submitted and the proxies' ports)."""
    apps = details.get("applications") or {}
    for wanted in document["applications"]:
        deployed = (apps.get(wanted["name"]) or {}).get("deployed_app_config") or {}
        if {k: deployed.get(k) for k in wanted} != wanted:
            return False
    http, grpc = details.get("http_options") or {}, details.get("grpc_options") or {}
    return http.get("port") == document["http_options"]["port"] and \
        grpc.get("port") == document["grpc_options"]["port"]


def app_status(details: dict[str, Any], names: list[str]) -> tuple[str, str]:
    """(status, message) of the applications `names` together: a failed one first, then one not yet running."""
    apps = details.get("applications") or {}
    states = [(str((apps.get(n) or {}).get("status") or "DEPLOYING"), str((apps.get(n) or {}).get("message") or ""))
              for n in names]
    for status, message in states:
        if status == SERVE_FAILED:
            return status, message
    return next(((s, m) for s, m in states if s != SERVE_RUNNING), (SERVE_RUNNING, ""))


def sync(api: ServeApi, document: dict[str, Any]) -> ServeState:
    """Apply `document` unless the head runs it already; the applications' status either way."""
    try:
        details = api.details()
        applied = not is_deployed(details, document)
        if applied:
            api.deploy(document)
            details = api.details()
    except ServeApiError as err:
        return ServeState(error=str(err))
    status, message = app_status(details, [a["name"] for a in document["applications"]])
    try:
        busy = frozenset(api.busy_nodes())
    except (ServeApiError, KeyError) as err:  # the state API is the same server: rarely alone in failing
        busy = None
        message = message or f"listing the Ray actors: {err}"
    return ServeState(status, message, applied, busy=busy)


def dashboard_url(settings: OperatorSettings, name: str, namespace: str) -> str:
    """The head's dashboard, by its pod DNS name under the headless Service (settings may override)."""
    return settings.dashboard_url.format(head=naming.head_name(name), headless=naming.headless_name(name),
                                         namespace=namespace, port=DASHBOARD_PORT, name=name)


def read_token(kube: Kube, namespace: str, name: str, spec: LLMServiceSpec) -> str | None:
    """The Ray token the pods run with, or None while its Secret does not exist."""
    secret = kube.get("Secret", namespace, ray_token_secret_name(name, spec))
    value = ((secret or {}).get("data") or {}).get(TOKEN_KEY)
    return base64.b64decode(value).decode() if value else None
