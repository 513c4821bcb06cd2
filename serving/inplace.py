"""The Serve config document of a ServeConfig, for Ray Serve's REST API (PUT /api/serve/applications/ on the
head's dashboard port), the way KubeRay's RayService applies serveConfigV2: applied in place to a running
cluster, and re-applied on each change.

What a change restarts (Ray Serve's in-place update rules):
    replicas                        deployments[LLMServer].num_replicas and Ingress.user_config: lightweight,
                                    replicas are added or removed and the others keep serving
    model, quantization, batching   the application's args: a code update, LLMServer replicas are replaced
                                    one at a time (rolling_update_percentage), the Ray cluster stays
"""
from __future__ import annotations

from typing import Any

from cpuserve.serving.app import APP_NAME, GRPC_SERVICER
from cpuserve.serving.config import ServeConfig

IMPORT_PATH = "cpuserve.serving.app:build_app"
# Scale-down and rolling updates wait this long for a replica's running streams to finish before it stops.
DRAIN_SECONDS = 300.0
# Args fields applied without a code update (through deployments overrides and user_config instead).
LIGHTWEIGHT = frozenset({"replicas"})
# Process-level fields of `cpuserve serve` that the REST API's own options carry (or that no replica reads).
PROXY_FIELDS = frozenset({"grpc_port", "http_port", "tls_cert_file", "tls_key_file", "ray_address"})


def application_args(config: ServeConfig) -> dict[str, Any]:
    """build_app's args: the config's explicitly set fields, less what is applied in place or by the proxies.
    Serve's proxies listen on http_port and grpc_port here (the document's options), so the Ingress does not."""
    args = {k: v for k, v in config.model_dump(exclude_unset=True).items()
            if k not in LIGHTWEIGHT | PROXY_FIELDS and v is not None}
    return {**args, "direct_http": False, "direct_grpc": False}


def build_serve_deploy_config(config: ServeConfig) -> dict[str, Any]:
    """The ServeDeploySchema document deploying cpuserve's app with `config` on a running Ray cluster."""
    http: dict[str, Any] = {"host": config.host, "port": config.http_port}
    if config.tls_cert_file:
        http.update(ssl_certfile=config.tls_cert_file, ssl_keyfile=config.tls_key_file)
    deployments = [
        {"name": "LLMServer", "num_replicas": config.replicas, "graceful_shutdown_timeout_s": DRAIN_SECONDS},
        # the ingress admits replicas x max_num_seqs + max_queued_requests: told the replicas without a restart
        {"name": "Ingress", "user_config": {"replicas": config.replicas}},
    ]
    return {
        "proxy_location": "HeadOnly",  # the Services point at the head; rank pods open no serving ports
        "http_options": http,
        "grpc_options": {"port": config.grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]},
        "applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": IMPORT_PATH,
                          "args": application_args(config), "deployments": deployments}],
    }
