"""Pod manifests: the Ray head (runs the Serve app) and one NUMA-pinned worker pod per rank.

    LLMService "chat", replicas 2, ranksPerReplica 2
      chat-head       ray start --head; cpuserve serve --ray-address auto ...   (Services point here)
      chat-g0-r0  chat-g0-r1  chat-g1-r0  chat-g1-r1                            (ray start --address=head,
                                                                                 one cpuserve_socket each)
Pure functions of the CR; names and labels come from naming.py.
"""
from __future__ import annotations

import copy
import json
import posixpath
from typing import Any

from cpuserve.engine.settings import ENGINE_HTTP_PORT, ENGINE_METRICS_PORT, GROUP, LLMSERVICE, RANK
from cpuserve.operator import naming
from cpuserve.operator.memory import GIB, MIB, MemoryPlan, download_size_limit, draft_model
from cpuserve.operator.security import DASHBOARD_PORT, ray_auth_env
from cpuserve.operator.settings import OperatorSettings
from cpuserve.operator.spec import LLMServiceSpec
from cpuserve.serving.ray_env import RAY_ENV

UID = 10001
MODEL_DIR = "/models"
TLS_DIR = "/etc/cpuserve/tls"
API_KEYS_DIR = "/etc/cpuserve/api-keys"
AGENT_PORT = 52365
OBJECT_STORE_BYTES = 256 * MIB
# Ray's log monitor pushes every log line of the node to the GCS for drivers that print them: the Serve app the
# operator applies has no driver, so no one reads them (the files stay, for the dashboard's log view). The head also
# skips Ray's autoscaler monitor (--no-monitor): the operator scales the pods. A `ray start --head` as the head pod
# runs it, measured on 2 cores of a Zen 5: 20 -> 18 processes, 766 -> 674 MiB PSS, up 0.3 s sooner.
NO_LOG_MONITOR = "--include-log-monitor=false"
# After a pod's preStop drain, the time its `ray start --block` takes to stop Ray's processes on SIGTERM
RAY_STOP_SECONDS = 15


def model_path(spec: LLMServiceSpec) -> str | None:
    """Where pods find the model (--model), or None for the image's embedded default."""
    m = spec.model
    if m.source == "pvc":
        return posixpath.join(MODEL_DIR, m.path or "")
    if m.source == "url":
        return f"{MODEL_DIR}/model.gguf" if m.format == "gguf" else f"{MODEL_DIR}/model"
    return None


def draft_model_path(spec: LLMServiceSpec) -> str | None:
    """Where pods find the draft model (--spec-draft-model): inside the model's claim, or None for the embedded one
    (or none at all)."""
    draft = draft_model(spec)
    if draft is None or draft.path is None:
        return None
    return posixpath.join(MODEL_DIR, draft.path)


def _container_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "privileged": False,
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def _env(name: str, spec: LLMServiceSpec) -> list[dict[str, Any]]:
    env = [{"name": "HOME", "value": "/tmp"}, *({"name": k, "value": v} for k, v in RAY_ENV.items()),
           {"name": LLMSERVICE.name, "value": name},
           {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    return env + ray_auth_env(name, spec)


def _volumes(spec: LLMServiceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts): writable /tmp and /dev/shm on a read-only root, the model, the HTTP API's secrets (the
    head serves it, and so does each pod that holds an engine)."""
    vols = [{"name": "tmp", "emptyDir": {}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{OBJECT_STORE_BYTES // MIB * 2}Mi"}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "shm", "mountPath": "/dev/shm"}]
    if spec.model.source == "pvc":
        vols.append({"name": "model", "persistentVolumeClaim": {"claimName": spec.model.claim_name, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    elif spec.model.source == "url":
        vols.append({"name": "model", "emptyDir": {"sizeLimit": download_size_limit(spec)}})
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    sec = spec.security
    if sec.tls_secret_name:
        vols.append({"name": "tls", "secret": {"secretName": sec.tls_secret_name, "defaultMode": 0o440}})
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
    if sec.api_keys is not None:
        vols.append({"name": "api-keys", "secret": {"secretName": sec.api_keys.name, "defaultMode": 0o440,
                                                    "items": [{"key": sec.api_keys.key, "path": sec.api_keys.key}]}})
        mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
    return vols, mounts


def _fetch_container(spec: LLMServiceSpec, image: str, pull: str, resources: dict[str, Any]) -> dict[str, Any]:
    """Init container that downloads the model into the pod's model emptyDir."""
    cmd = ["python", "-m", "cpuserve.operator.fetch", "--url", spec.model.url or "", "--dest", model_path(spec) or ""]
    if spec.model.sha256:
        cmd += ["--sha256", spec.model.sha256]
    return {"name": "fetch-model", "image": image, "imagePullPolicy": pull, "command": cmd,
            "env": [{"name": "HOME", "value": "/tmp"}], "resources": resources,
            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "model", "mountPath": MODEL_DIR}],
            "securityContext": _container_security()}


def _pod(name: str, pod_name: str, labels: dict[str, str], spec: LLMServiceSpec, settings: OperatorSettings,
         container: dict[str, Any], head: bool) -> dict[str, Any]:
    image = spec.image or settings.image
    pull = settings.image_pull_policy
    vols, mounts = _volumes(spec)
    container.update(image=image, imagePullPolicy=pull, env=_env(name, spec), volumeMounts=mounts,
                     securityContext=_container_security(), lifecycle=_drain_on_stop(spec, head))
    pod_spec: dict[str, Any] = {
        "hostname": pod_name, "subdomain": naming.headless_name(name), "enableServiceLinks": False,
        "automountServiceAccountToken": False, "restartPolicy": "Always",
        "terminationGracePeriodSeconds": spec.drain_timeout_seconds + RAY_STOP_SECONDS,
        "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container], "volumes": vols,
    }
    if spec.model.source == "url":
        pod_spec["initContainers"] = [_fetch_container(spec, image, pull, copy.deepcopy(container["resources"]))]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod_name, "labels": labels}, "spec": pod_spec}


def _drain_on_stop(spec: LLMServiceSpec, head: bool) -> dict[str, Any]:
    """preStop, as `cpuserve serve` on SIGTERM: the head's Ingress refuses new requests and the running ones finish,
    up to drainTimeoutSeconds; a rank pod keeps its rank serving them meanwhile (when the whole service goes, every
    pod gets SIGTERM at once, and a rank stopping early would fail the requests the head is draining)."""
    command = ["cpuserve", "drain", f"--timeout-s={spec.drain_timeout_seconds}"] + ([] if head else ["--wait-only"])
    return {"preStop": {"exec": {"command": command}}}


def _resources(cpus: int, memory: str) -> dict[str, Any]:
    """requests == limits with integer CPUs: Guaranteed QoS, exclusive cores under the static CPU manager."""
    amount = {"cpu": str(cpus), "memory": memory}
    return {"requests": dict(amount), "limits": dict(amount)}


def _health_probe(spec: LLMServiceSpec) -> dict[str, Any]:
    """Ready while the HTTP API's /health answers 200: it runs a token through an idle replica (or answers at once
    when its step is stalled), so it gets time."""
    scheme = "HTTPS" if spec.security.tls_secret_name else "HTTP"
    return {"httpGet": {"path": "/health", "port": "http", "scheme": scheme},
            "periodSeconds": 5, "timeoutSeconds": 10, "failureThreshold": 3}


def build_head_pod(name: str, spec: LLMServiceSpec, settings: OperatorSettings) -> dict[str, Any]:
    """The Ray head pod: the head node only. The operator applies the Serve app to it through Ray Serve's REST API
    (serve_api.py), so replicas, batching and quantization never change this pod."""
    p, r = spec.ports, spec.resources
    container = {
        "name": "serve",
        "command": ["ray", "start", "--head", f"--port={naming.RAY_GCS_PORT}", f"--num-cpus={r.head_cpus}",
                    "--dashboard-host=0.0.0.0", f"--dashboard-port={DASHBOARD_PORT}",
                    f"--dashboard-agent-listen-port={AGENT_PORT}", f"--object-store-memory={OBJECT_STORE_BYTES}",
                    NO_LOG_MONITOR, "--no-monitor", "--disable-usage-stats", "--block"],
        "ports": [{"name": "grpc", "containerPort": p.grpc}, {"name": "http", "containerPort": p.http},
                  {"name": "metrics", "containerPort": p.metrics},
                  {"name": "gcs", "containerPort": naming.RAY_GCS_PORT},
                  {"name": "dashboard", "containerPort": DASHBOARD_PORT}],
        "resources": _resources(r.head_cpus, f"{int(r.head_memory_gb * GIB) // MIB}Mi"),
        "readinessProbe": _health_probe(spec),
        "livenessProbe": {"tcpSocket": {"port": "gcs"}, "initialDelaySeconds": 30, "periodSeconds": 10},
    }
    labels = {**naming.base_labels(name), naming.LABEL_COMPONENT: "head"}
    return _pod(name, naming.head_name(name), labels, spec, settings, container, head=True)


def _rank_affinity(name: str, group: int, spec: LLMServiceSpec) -> dict[str, Any]:
    """spread: ranks of one group never share a node (so never a socket); pack: prefer one node."""
    term = {"labelSelector": {"matchLabels": {naming.LABEL_SERVICE: name, naming.LABEL_GROUP: str(group)}},
            "topologyKey": "kubernetes.io/hostname"}
    if spec.placement.mode == "spread":
        return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    return {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]}}


def _rank_pod(name: str, group: int, rank: int, spec: LLMServiceSpec, settings: OperatorSettings,
              plan: MemoryPlan) -> dict[str, Any]:
    """One rank: a Ray worker node offering one unit of the socket resource, pinned to a NUMA node."""
    cpus = spec.resources.cpus_per_rank
    head_address = f"{naming.head_name(name)}.{naming.headless_name(name)}:{naming.RAY_GCS_PORT}"
    container = {
        "name": "rank",
        "command": ["ray", "start", f"--address={head_address}", f"--num-cpus={cpus}",
                    "--resources=" + json.dumps({naming.SOCKET_RESOURCE: 1}),
                    f"--object-store-memory={OBJECT_STORE_BYTES}", f"--dashboard-agent-listen-port={AGENT_PORT}",
                    NO_LOG_MONITOR, "--disable-usage-stats", "--block"],
        # the LLMServer replica that lands on this Ray node serves its engine's gauges there (serving/engine_metrics.py)
        "ports": [{"name": "agent", "containerPort": AGENT_PORT},
                  {"name": "engine-metrics", "containerPort": spec.ports.engine_metrics}],
        "resources": _resources(cpus, plan.quantity),
        "readinessProbe": {"httpGet": {"path": "/api/local_raylet_healthz", "port": "agent"},
                           "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/api/local_raylet_healthz", "port": "agent"},
                          "initialDelaySeconds": 30, "periodSeconds": 10, "failureThreshold": 6},
    }
    if rank == 0:  # its group's engine (serving/app.py places rank 0 here) answers the OpenAI API on the pod's port
        container["ports"].append({"name": "http", "containerPort": spec.ports.http})
        container["readinessProbe"] = _health_probe(spec)  # an InferencePool's gateway sends only to ready pods
    labels = {**naming.base_labels(name), naming.LABEL_COMPONENT: "rank",
              naming.LABEL_GROUP: str(group), naming.LABEL_RANK: str(rank)}
    pod = _pod(name, naming.rank_name(name, group, rank), labels, spec, settings, container, head=False)
    container["env"] += [{"name": GROUP.name, "value": str(group)}, {"name": RANK.name, "value": str(rank)},
                         {"name": ENGINE_METRICS_PORT.name, "value": str(spec.ports.engine_metrics)}]
    if rank == 0:
        container["env"].append({"name": ENGINE_HTTP_PORT.name, "value": str(spec.ports.http)})
    pod["spec"]["nodeSelector"] = {settings.numa_node_label: "true", **spec.placement.node_selector}
    pod["spec"]["affinity"] = _rank_affinity(name, group, spec)
    return pod


def rank_template_hash(name: str, spec: LLMServiceSpec, settings: OperatorSettings, plan: MemoryPlan) -> str:
    """The hash of what every rank pod runs (the first rank pod's manifest, and the ranks of a group); with the
    engine's Serve args it makes the rank pods' revision (serve_document.revision)."""
    return naming.spec_hash({"pod": _rank_pod(name, 0, 0, spec, settings, plan), "ranks": spec.ranks_per_replica})


def build_rank_pod(name: str, group: int, rank: int, spec: LLMServiceSpec, settings: OperatorSettings,
                   plan: MemoryPlan, revision: str) -> dict[str, Any]:
    """One rank pod of `revision`; its Ray node is named after the pod and labelled with the revision and the rank
    (the operator reads which pods run Ray actors by those names; Serve places replicas by the revision, and a
    group's rank 0, its engine, on a rank-0 pod, the one that declares the HTTP port)."""
    pod = _rank_pod(name, group, rank, spec, settings, plan)
    pod["metadata"]["labels"][naming.LABEL_REVISION] = revision
    command = pod["spec"]["containers"][0]["command"]
    command[-1:-1] = [f"--node-name={pod['metadata']['name']}",
                      f"--labels={naming.LABEL_REVISION}={revision},{naming.LABEL_RANK}={rank}"]
    return pod
