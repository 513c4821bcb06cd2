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
from cpuserve.operator.kube import Kube
from cpuserve.operator.security import DASHBOARD_PORT, TOKEN_KEY, ray_token_secret_name
from cpuserve.operator.settings import OperatorSettings
from cpuserve.operator.spec import LLMServiceSpec
from cpuserve.serving.names import APP_NAME

APPLICATIONS = "/api/serve/applications/"
TIMEOUT_SECONDS = 10.0


class ServeApiError(Exception):
    """The head's Serve REST API could not be reached or refused the config."""


@dataclass(frozen=True, slots=True)
class ServeState:
    """What the head said: the application's status (RUNNING, DEPLOYING, DEPLOY_FAILED, ...) and message,
    whether this pass applied a new config, or why the API could not be used."""

    status: str = ""
    message: str = ""
    applied: bool = False
    error: str = ""


class ServeApi:
    """The Serve REST API of one Ray head, authenticated with the cluster's Ray token."""

    def __init__(self, base_url: str, token: str, timeout: float = TIMEOUT_SECONDS):
        self.url = base_url.rstrip("/") + APPLICATIONS
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self.timeout = timeout

    def _call(self, method: str, body: Any = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url, data=data, method=method, headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as rsp:  # noqa: S310 (http URL from settings)
                text = rsp.read()
        except urllib.error.HTTPError as err:
            raise ServeApiError(f"{method} {self.url}: HTTP {err.code}: {err.read()[:300].decode(errors='replace')}")
        except OSError as err:  # refused, unresolvable, timed out: the head is not up yet
            raise ServeApiError(f"{method} {self.url}: {err}") from err
        return json.loads(text) if text.strip() else {}

    def details(self) -> dict[str, Any]:
        return self._call("GET")

    def deploy(self, document: dict[str, Any]) -> None:
        self._call("PUT", document)


def is_deployed(details: dict[str, Any], document: dict[str, Any]) -> bool:
    """Whether the head already runs `document` (the application as submitted and the proxies' ports)."""
    app = (details.get("applications") or {}).get(APP_NAME) or {}
    wanted = document["applications"][0]
    deployed = app.get("deployed_app_config") or {}
    same_app = {k: deployed.get(k) for k in wanted} == wanted
    http, grpc = details.get("http_options") or {}, details.get("grpc_options") or {}
    return same_app and http.get("port") == document["http_options"]["port"] and \
        grpc.get("port") == document["grpc_options"]["port"]


def sync(api: ServeApi, document: dict[str, Any]) -> ServeState:
    """Apply `document` unless the head runs it already; the application's status either way."""
    try:
        details = api.details()
        applied = not is_deployed(details, document)
        if applied:
            api.deploy(document)
            details = api.details()
    except ServeApiError as err:
        return ServeState(error=str(err))
    app = (details.get("applications") or {}).get(APP_NAME) or {}
    return ServeState(str(app.get("status") or "DEPLOYING"), str(app.get("message") or ""), applied)


def dashboard_url(settings: OperatorSettings, name: str, namespace: str) -> str:
    """The head's dashboard, by its pod DNS name under the headless Service (settings may override)."""
    return settings.dashboard_url.format(head=naming.head_name(name), headless=naming.headless_name(name),
                                         namespace=namespace, port=DASHBOARD_PORT, name=name)


def read_token(kube: Kube, namespace: str, name: str, spec: LLMServiceSpec) -> str | None:
    """The Ray token the pods run with, or None while its Secret does not exist."""
    secret = kube.get("Secret", namespace, ray_token_secret_name(name, spec))
    value = ((secret or {}).get("data") or {}).get(TOKEN_KEY)
    return base64.b64decode(value).decode() if value else None
