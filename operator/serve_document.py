"""The Serve config document of an LLMService, for Ray Serve's REST API (PUT /api/serve/applications/ on the
head's dashboard port), the way KubeRay's RayService applies serveConfigV2: applied in place to a running
cluster, and re-applied on each change.

Two applications (serving/names.py): APP_NAME holds the Ingress, ENGINE_APP_NAME the LLMServer replicas. Serve
versions every deployment of an application by the hash of the application's args, so the engine's args live in
the engine's application and a model change never restarts the Ingress.

What a change restarts (Ray Serve's in-place update rules):
    replicas                        LLMServer num_replicas, the Ingress's user_config: lightweight, replicas are
                                    added or removed and the others keep serving
    model, quantization, batching,  the engine application's args, and the rank pods' revision (revision()): a code
    the rank pods                   update. With max_surge_percent one new replica starts, on a rank pod of the new
                                    revision, before an old one drains and stops, so a one-replica service answers
                                    throughout; the Ingress stays

The args are ServeConfig fields (serving/config.py), built here as plain data: the operator runs without the
serving stack installed. tests/operator/test_operator_serve_document.py checks that serving accepts them for
every value the CRD allows; the head validates them again when it builds the apps.
"""
from __future__ import annotations

from typing import Any

from cpuserve.operator import naming
from cpuserve.operator.pods import API_KEYS_DIR, TLS_DIR, draft_model_path, model_path
from cpuserve.operator.spec import SERVE_FIELDS_FROM_SPEC, LLMServiceSpec
from cpuserve.serving.names import (APP_NAME, ENGINE_APP_NAME, ENGINE_IMPORT_PATH, GRPC_SERVICER, INGRESS_DEPLOYMENT,
                                    INGRESS_IMPORT_PATH, SERVER_DEPLOYMENT)

# Scale-down and rolling updates wait this long for a replica's running streams to finish before it stops.
DRAIN_SECONDS = 300.0
# Args fields applied without a code update (through deployments overrides and user_config instead).
LIGHTWEIGHT = frozenset({"replicas"})
# Process-level fields of `cpuserve serve` that the REST API's own options carry (or that no replica reads).
PROXY_FIELDS = frozenset({"grpc_port", "http_port", "tls_cert_file", "tls_key_file", "ray_address"})
# What the Ingress reads from its args; the admission limits it takes from its user_config (INGRESS_LIMITS).
INGRESS_FIELDS = frozenset({"host", "metrics_port", "api_key_file"})
INGRESS_LIMITS = ("replicas", "max_num_seqs", "max_queued_requests")


# The spec's other fields: where each goes instead (a folder: all of its fields)
SPEC_ELSEWHERE = {
    "replicas": "serve_fields: replicas, at least 1 (at 0 the one LLMServer replica waits for a rank pod)",
    "model": "the pods (pods.py); serve_fields: model, the pod's path of it",
    "security": "the Secrets of the head and rank pods (pods.py); serve_fields: api_key_file, tls_cert_file, "
                "tls_key_file",
    "resources.overhead_gb": "memory.py", "resources.memory_per_rank_gb": "memory.py",
    "resources.head_cpus": "pods.py", "resources.head_memory_gb": "pods.py",
    "ports.engine_metrics": "pods.py (the rank pods' CPUSERVE_ENGINE_METRICS_PORT)",
    # ports.http is also the rank-0 pods' CPUSERVE_ENGINE_HTTP_PORT (pods.py)
    "placement": "pods.py (node selector, affinity)", "image": "pods.py",
    "drain_timeout_seconds": "pods.py (preStop `cpuserve drain --timeout-s`, terminationGracePeriodSeconds)",
    "speculative.draft.path": "serve_fields: spec_draft_model, the pod's path of it (pods.py)",
    "speculative.draft.num_parameters": "memory.py (the rank-0 pods')",
}
# What every head serves with, whatever the spec: all interfaces, the pod's Ray cluster, and each rank pod its own
# Ray node offering one socket unit, so a group's bundles land on k pods
HEAD_FIELDS = {"host": "0.0.0.0", "ray_address": "auto", "socket_resource": naming.SOCKET_RESOURCE,
               "placement_strategy": "STRICT_SPREAD"}


def spec_value(spec: LLMServiceSpec, path: str) -> Any:
    """The spec's field at `path` (dotted snake_case names); None under an object that is not set."""
    value: Any = spec
    for name in path.split("."):
        value = None if value is None else getattr(value, name)
    return value


def serve_fields(spec: LLMServiceSpec) -> dict[str, Any]:
    """The ServeConfig fields the head serves with (snake_case, only those set; the paths are the pod's)."""
    fields = {name: value for name, path in SERVE_FIELDS_FROM_SPEC.items()
              if (value := spec_value(spec, path)) is not None}
    fields.update(HEAD_FIELDS, replicas=max(spec.replicas, 1))
    if (path := model_path(spec)) is not None:
        fields["model"] = path
    if (path := draft_model_path(spec)) is not None:
        fields["spec_draft_model"] = path
    if spec.security.api_keys is not None:
        fields["api_key_file"] = f"{API_KEYS_DIR}/{spec.security.api_keys.key}"
    if spec.security.tls_secret_name:
        fields.update(tls_cert_file=f"{TLS_DIR}/tls.crt", tls_key_file=f"{TLS_DIR}/tls.key")
    return fields


def application_args(fields: dict[str, Any]) -> dict[str, Any]:
    """build_app's args (the whole graph as one application): the fields less what is applied in place or by the
    proxies. Serve's proxies listen on http_port and grpc_port here (the document's options), so the Ingress
    does not."""
    args = {k: v for k, v in fields.items() if k not in LIGHTWEIGHT | PROXY_FIELDS and v is not None}
    return {**args, "direct_http": False, "direct_grpc": False}


def ingress_args(fields: dict[str, Any]) -> dict[str, Any]:
    """build_ingress_app's args: nothing a model, quantization or batching change touches."""
    return {k: v for k, v in application_args(fields).items() if k in INGRESS_FIELDS | {"direct_http", "direct_grpc"}}


def engine_args(fields: dict[str, Any], revision: str | None) -> dict[str, Any]:
    """build_engine_app's args; with the rank pods' revision, replicas run only on that revision's Ray nodes. Each
    replica serves the HTTP API on its own pod too (serving/engine_http.py): the API keys and TLS go with it."""
    args = {k: v for k, v in application_args(fields).items() if k not in INGRESS_FIELDS - {"host", "api_key_file"}}
    args.update({k: fields[k] for k in ("tls_cert_file", "tls_key_file") if k in fields})
    if revision:
        args["node_labels"] = f"{naming.LABEL_REVISION}={revision}"
    return args


def revision(spec: LLMServiceSpec, template_hash: str) -> str:
    """The rank pods' revision: what they run (pods.rank_template_hash) and what the LLMServer replicas on them run
    (the engine's args). Any change of either rolls the replicas onto new rank pods with a surge (rollout.py), so a
    batching change needs no free socket among the pods that serve."""
    return naming.spec_hash({"pods": template_hash, "engine": engine_args(serve_fields(spec), None)})


def surge_percent(replicas: int) -> int:
    """Serve's max_surge_percent that lets one replica (rounded up by Serve) start before an old one stops."""
    return max(1, 100 // replicas)


def build_serve_document(spec: LLMServiceSpec, revision: str | None = None) -> dict[str, Any]:
    """The ServeDeploySchema document deploying cpuserve's two applications for `spec` on its running Ray head.

    Args:
        revision: the rank pods' revision (revision()); None places replicas on any Ray node.
    """
    fields = serve_fields(spec)
    http: dict[str, Any] = {"host": fields["host"], "port": fields["http_port"]}
    if "tls_cert_file" in fields:
        http.update(ssl_certfile=fields["tls_cert_file"], ssl_keyfile=fields["tls_key_file"])
    server = {"name": SERVER_DEPLOYMENT, "num_replicas": fields["replicas"],
              "graceful_shutdown_timeout_s": DRAIN_SECONDS, "max_surge_percent": surge_percent(fields["replicas"])}
    # the ingress admits replicas x max_num_seqs + max_queued_requests: told without a restart
    ingress = {"name": INGRESS_DEPLOYMENT, "user_config": {k: fields[k] for k in INGRESS_LIMITS}}
    return {
        # the Services point at the head; a rank-0 pod's own HTTP port is its replica's (serving/engine_http.py)
        "proxy_location": "HeadOnly",
        "http_options": http,
        "grpc_options": {"port": fields["grpc_port"], "grpc_servicer_functions": [GRPC_SERVICER]},
        "applications": [
            {"name": APP_NAME, "route_prefix": "/", "import_path": INGRESS_IMPORT_PATH,
             "args": ingress_args(fields), "deployments": [ingress]},
            {"name": ENGINE_APP_NAME, "route_prefix": None, "import_path": ENGINE_IMPORT_PATH,
             "args": engine_args(fields, revision), "deployments": [server]},
        ],
    }
