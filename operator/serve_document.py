"""The Serve config document of an LLMService, for Ray Serve's REST API (PUT /api/serve/applications/ on the
head's dashboard port), the way KubeRay's RayService applies serveConfigV2: applied in place to a running
cluster, and re-applied on each change.

What a change restarts (Ray Serve's in-place update rules):
    replicas                        deployments[LLMServer].num_replicas and Ingress.user_config: lightweight,
                                    replicas are added or removed and the others keep serving
    model, quantization, batching   the application's args: a code update, LLMServer replicas are replaced
                                    one at a time (rolling_update_percentage), the Ray cluster stays

The args are ServeConfig fields (serving/config.py), built here as plain data: the operator runs without the
serving stack installed. tests/operator/test_operator_serve_document.py checks that serving accepts them for
every value the CRD allows; the head validates them again when it builds the app.
"""
from __future__ import annotations

from typing import Any

from cpuserve.operator import naming
from cpuserve.operator.pods import API_KEYS_DIR, TLS_DIR, model_path
from cpuserve.operator.spec import LLMServiceSpec
from cpuserve.serving.names import APP_NAME, GRPC_SERVICER, IMPORT_PATH

# Scale-down and rolling updates wait this long for a replica's running streams to finish before it stops.
DRAIN_SECONDS = 300.0
# Args fields applied without a code update (through deployments overrides and user_config instead).
LIGHTWEIGHT = frozenset({"replicas"})
# Process-level fields of `cpuserve serve` that the REST API's own options carry (or that no replica reads).
PROXY_FIELDS = frozenset({"grpc_port", "http_port", "tls_cert_file", "tls_key_file", "ray_address"})


def serve_fields(spec: LLMServiceSpec) -> dict[str, Any]:
    """The ServeConfig fields the head serves with (snake_case, only those set; the paths are the pod's)."""
    q, r, b, p = spec.quantization, spec.resources, spec.batching, spec.ports
    fields = dict(weights=q.weights, group_size=q.group_size, activations=q.activations, kv_cache=q.kv_cache,
                  kv_cache_gb=r.kv_cache_gb,
                  # at replicas 0 there are no rank pods: the app's one LLMServer replica waits for a rank pod
                  # (cpuserve serve refuses --replicas 0)
                  replicas=max(spec.replicas, 1), ranks_per_replica=spec.ranks_per_replica,
                  cpus_per_rank=r.cpus_per_rank, max_num_seqs=b.max_num_seqs,
                  max_num_batched_tokens=b.max_num_batched_tokens, max_queued_requests=b.max_queued_requests,
                  host="0.0.0.0", grpc_port=p.grpc, http_port=p.http, metrics_port=p.metrics, ray_address="auto",
                  socket_resource=naming.SOCKET_RESOURCE,
                  # each rank pod is its own Ray node offering one socket unit: a group's bundles land on k pods
                  placement_strategy="STRICT_SPREAD")
    if b.max_queued_tokens is not None:  # only when set: the args of a service that never set it stay as they were
        fields["max_queued_tokens"] = b.max_queued_tokens
    if (path := model_path(spec)) is not None:
        fields["model"] = path
    if spec.security.api_keys is not None:
        fields["api_key_file"] = f"{API_KEYS_DIR}/{spec.security.api_keys.key}"
    if spec.security.tls_secret_name:
        fields.update(tls_cert_file=f"{TLS_DIR}/tls.crt", tls_key_file=f"{TLS_DIR}/tls.key")
    return fields


def application_args(fields: dict[str, Any]) -> dict[str, Any]:
    """build_app's args: the fields less what is applied in place or by the proxies. Serve's proxies listen on
    http_port and grpc_port here (the document's options), so the Ingress does not."""
    args = {k: v for k, v in fields.items() if k not in LIGHTWEIGHT | PROXY_FIELDS and v is not None}
    return {**args, "direct_http": False, "direct_grpc": False}


def build_serve_document(spec: LLMServiceSpec) -> dict[str, Any]:
    """The ServeDeploySchema document deploying cpuserve's app for `spec` on its running Ray head."""
    fields = serve_fields(spec)
    http: dict[str, Any] = {"host": fields["host"], "port": fields["http_port"]}
    if "tls_cert_file" in fields:
        http.update(ssl_certfile=fields["tls_cert_file"], ssl_keyfile=fields["tls_key_file"])
    deployments = [
        {"name": "LLMServer", "num_replicas": fields["replicas"], "graceful_shutdown_timeout_s": DRAIN_SECONDS},
        # the ingress admits replicas x max_num_seqs + max_queued_requests: told the replicas without a restart
        {"name": "Ingress", "user_config": {"replicas": fields["replicas"]}},
    ]
    return {
        "proxy_location": "HeadOnly",  # the Services point at the head; rank pods open no serving ports
        "http_options": http,
        "grpc_options": {"port": fields["grpc_port"], "grpc_servicer_functions": [GRPC_SERVICER]},
        "applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": IMPORT_PATH,
                          "args": application_args(fields), "deployments": deployments}],
    }
