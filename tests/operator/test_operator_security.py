"""Ray locked down: token auth wired into every pod from a per-LLMService Secret, and a NetworkPolicy that lets
only the service's own pods and the operator reach Ray's ports while clients reach only the serving ports."""
from __future__ import annotations

import base64

import kubernetes_validate
import pytest

from cpuserve.operator import naming
from cpuserve.operator.children import build_children
from cpuserve.operator.security import build_ray_token_secret
from cpuserve.operator.settings import OperatorSettings
from cpuserve.operator.validation import validate
from llmservice_factory import K8S_VERSION, make_body

SETTINGS = OperatorSettings(pod_namespace="cpuserve-system")
URL_MODEL = {"source": "url", "url": "https://example.invalid/m.gguf", "numParameters": 1_000_000_000}
SHAPES = [{}, {"replicas": 2, "ranksPerReplica": 2}, {"replicas": 3, "model": URL_MODEL}]


def children(**spec):
    body = make_body(**spec)
    parsed, findings = validate(body, SETTINGS)
    assert findings == []
    return build_children(body, parsed, SETTINGS, False)


def env_of(container):
    return {e["name"]: e for e in container["env"]}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("secret,expected", [(None, "chat-ray-token"), ("my-ray", "my-ray")])
def test_every_pod_runs_ray_with_token_auth(shape, secret, expected):
    spec = {**shape, **({"security": {"rayAuthTokenSecret": secret}} if secret else {})}
    pods = [m for m in children(**spec) if m["kind"] == "Pod"]
    assert len(pods) == 1 + shape.get("replicas", 1) * shape.get("ranksPerReplica", 1)
    for pod in pods:
        (container,) = pod["spec"]["containers"]  # the init container (URL model) runs no Ray
        env = env_of(container)
        assert env["RAY_AUTH_MODE"]["value"] == "token", pod["metadata"]["name"]
        assert env["RAY_AUTH_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": expected, "key": "token"}}


def test_the_generated_secret_is_valid_and_holds_the_token():
    body = make_body()
    secret = naming.finish(build_ray_token_secret("chat", "s3cret-token"), body)
    kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
    assert secret["metadata"]["name"] == "chat-ray-token" and secret["immutable"] is True
    assert base64.b64decode(secret["data"]["token"]).decode() == "s3cret-token"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]


# ---- an independent reading of NetworkPolicy semantics (Kubernetes docs, "Network Policies") ----
NAMESPACES = {"default": {"kubernetes.io/metadata.name": "default"},
              "cpuserve-system": {"kubernetes.io/metadata.name": "cpuserve-system"},
              "clients": {"kubernetes.io/metadata.name": "clients"}}


def selects(selector, labels):
    assert set(selector) <= {"matchLabels"}, "only matchLabels is read here"
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def peer_matches(peer, policy_ns, src_ns, src_labels):
    if "namespaceSelector" not in peer:  # a bare podSelector means the policy's own namespace
        return src_ns == policy_ns and selects(peer["podSelector"], src_labels)
    return selects(peer["namespaceSelector"], NAMESPACES[src_ns]) and selects(peer.get("podSelector", {}), src_labels)


def allowed(policies, src_ns, src_labels, dst_ns, dst_labels, port):
    """Ingress from a pod to a pod's port: allowed unless a policy selects the target and no rule admits it."""
    ingress = [p for p in policies if p["metadata"]["namespace"] == dst_ns and "Ingress" in p["spec"]["policyTypes"]
               and selects(p["spec"]["podSelector"], dst_labels)]
    if not ingress:
        return True
    return any((not rule.get("ports") or any(p["port"] == port for p in rule["ports"]))
               and (not rule.get("from") or any(peer_matches(peer, dst_ns, src_ns, src_labels) for peer in rule["from"]))
               for policy in ingress for rule in policy["spec"].get("ingress", []))


GCS, DASHBOARD, AGENT, WORKER, GRPC, HTTP, METRICS = 6379, 8265, 52365, 10002, 9000, 8000, 8080
HEAD = {"cpuserve.dev/llmservice": "chat", "app.kubernetes.io/component": "head"}
RANK = {"cpuserve.dev/llmservice": "chat", "app.kubernetes.io/component": "rank"}
OTHER_SERVICE = {"cpuserve.dev/llmservice": "other", "app.kubernetes.io/component": "head"}
OPERATOR = {"app.kubernetes.io/name": "cpuserve", "app.kubernetes.io/instance": "rel",
            "app.kubernetes.io/component": "operator"}
CLIENT = {"app": "client"}
CASES = [  # (source namespace, source labels, target labels, port, allowed)
    ("clients", CLIENT, HEAD, GRPC, True), ("clients", CLIENT, HEAD, HTTP, True),
    ("clients", CLIENT, HEAD, METRICS, True), ("clients", CLIENT, HEAD, GCS, False),
    ("clients", CLIENT, HEAD, DASHBOARD, False), ("clients", CLIENT, RANK, AGENT, False),
    ("clients", CLIENT, RANK, WORKER, False),
    ("default", CLIENT, HEAD, GCS, False), ("default", OTHER_SERVICE, HEAD, GCS, False),
    ("default", OTHER_SERVICE, RANK, WORKER, False),
    ("default", RANK, HEAD, GCS, True), ("default", HEAD, RANK, WORKER, True), ("default", RANK, RANK, WORKER, True),
    ("cpuserve-system", OPERATOR, HEAD, DASHBOARD, True), ("cpuserve-system", OPERATOR, HEAD, GCS, False),
    ("clients", OPERATOR, HEAD, DASHBOARD, False),  # the operator's labels outside its namespace
]


@pytest.mark.parametrize("src_ns,src,dst,port,expected", CASES)
def test_network_policy_keeps_ray_to_the_service_and_the_operator(src_ns, src, dst, port, expected):
    policies = [m for m in children(replicas=2) if m["kind"] == "NetworkPolicy"]
    assert [p["metadata"]["name"] for p in policies] == ["chat-ray"]
    assert allowed(policies, src_ns, src, "default", dst, port) is expected


def test_the_operator_labels_default_to_the_charts():
    assert OperatorSettings().operator_pod_labels() == {"app.kubernetes.io/name": "cpuserve",
                                                       "app.kubernetes.io/component": "operator"}
