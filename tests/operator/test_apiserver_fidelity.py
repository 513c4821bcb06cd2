"""Where a real kube-apiserver differs from a naive object store, the fake does what the real one does.

Each scenario runs against the fake server, and against a real control plane when KUBEBUILDER_ASSETS names
one (envtest's convention; skipped with the reason otherwise). Every call goes through the operator's own
client (operator/kube.py). Each test failed against the fake server as it was before these behaviours.
"""
from __future__ import annotations

import pytest

from control_plane import RealControlPlane, assets_missing, start_fake
from cpuserve.operator.kube import Kube, KubeError
from cpuserve.operator.spec import BatchingSpec

pytestmark = pytest.mark.timeout(180)
NS = "fidelity"
LLMS_PATH = f"/apis/cpuserve.dev/v1alpha1/namespaces/{NS}/llmservices"


@pytest.fixture(scope="module", params=["fake", "real"])
def server(request, tmp_path_factory):
    if request.param == "real" and (why := assets_missing()):
        pytest.skip(f"real control plane: {why}")
    plane = RealControlPlane() if request.param == "real" else None
    srv = plane.start() if plane else start_fake(tmp_path_factory.mktemp("fake"))
    try:
        srv.create_namespace(NS)
        yield srv
    finally:
        plane.stop() if plane else srv.fake.stop()


def llmservice(name: str, **spec) -> dict:
    spec.setdefault("model", {"source": "embedded"})
    return {"apiVersion": "cpuserve.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": name, "namespace": NS},
            "spec": spec}


def pod(name: str, ns: str = NS, **container) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
            "spec": {"containers": [{"name": "c", "image": "registry.invalid/c:1", **container}]}}


def refused(call, *args) -> KubeError:
    with pytest.raises(KubeError) as info:
        call(*args)
    return info.value


def test_a_pod_is_refused_until_its_service_account_exists(server):
    ns = "fresh-namespace"
    server.create_namespace(ns, with_default_service_account=False)
    err = refused(server.kube.create, pod("early", ns))
    assert (err.status, err.reason) == (403, "Forbidden")
    assert f'error looking up service account {ns}/default: serviceaccount "default" not found' in err.message
    server.create_service_account(ns, "default")
    assert server.kube.create(pod("early", ns))["metadata"]["name"] == "early"


def test_unknown_fields_are_pruned_without_strict_validation(server):
    body = llmservice("pruned", bogus=1)
    body["spec"]["model"]["extra"] = "x"
    server.kube._call("POST", LLMS_PATH, body=body)  # no fieldValidation parameter: the server's default (Warn)
    stored = server.kube.get("LLMService", NS, "pruned")
    assert "bogus" not in stored["spec"] and "extra" not in stored["spec"]["model"]
    server.kube._call("POST", f"/api/v1/namespaces/{NS}/pods", body=pod("pruned-pod", bogus=True))
    assert "bogus" not in server.kube.get("Pod", NS, "pruned-pod")["spec"]["containers"][0]


def test_strict_field_validation_refuses_unknown_fields(server):
    err = refused(server.kube.create, llmservice("strict", bogus=1))  # the operator's writes are strict
    assert (err.status, err.reason) == (400, "BadRequest") and 'unknown field "spec.bogus"' in err.message
    err = refused(server.kube.create, pod("strict-pod", bogus=True))
    assert (err.status, err.reason) == (400, "BadRequest")
    assert 'unknown field "spec.containers[0].bogus"' in err.message
    assert server.kube.get("LLMService", NS, "strict") is None and server.kube.get("Pod", NS, "strict-pod") is None


def test_crd_schema_defaults_are_applied_on_create(server):
    server.kube.create(llmservice("defaults", batching={}))
    spec = server.kube.get("LLMService", NS, "defaults")["spec"]
    assert spec["batching"] == BatchingSpec().model_dump(by_alias=True, exclude_none=True)  # the model's defaults
    assert spec["replicas"] == 1 and spec["ranksPerReplica"] == 1 and spec["model"]["format"] == "gguf"
    assert spec["drainTimeoutSeconds"] == 30


def test_crd_schema_refuses_invalid_values(server):
    err = refused(server.kube.create, llmservice("negative", replicas=-1))
    assert (err.status, err.reason) == (422, "Invalid") and "replicas" in err.message


def test_crd_cel_rule_refuses_token_scales_without_int8_weights(server):
    """The CRD's x-kubernetes-validations rule (operator/spec.py): a schema-valid spec the rule refuses, named by its
    fieldPath; the same scheme with int8 weights is stored, and the default filled in where it is absent."""
    err = refused(server.kube.create, llmservice("tokens", quantization={"activations": "int8-token"}))
    assert (err.status, err.reason) == (422, "Invalid"), err.message
    assert "spec.quantization.activations" in err.message and "needs weights int8" in err.message
    server.kube.create(llmservice("tokens", quantization={"weights": "int8", "activations": "int8-token"}))
    assert server.kube.get("LLMService", NS, "tokens")["spec"]["quantization"]["activations"] == "int8-token"
    server.kube.create(llmservice("groups", quantization={"weights": "int8"}))
    assert server.kube.get("LLMService", NS, "groups")["spec"]["quantization"]["activations"] == "int8"


def test_max_queued_tokens_is_bounded_and_has_no_stored_default(server):
    """spec.batching.maxQueuedTokens: the schema refuses 0 naming the field; a value is stored; left out, it stays out
    (serving then derives it from the replica's cores) while the other batching defaults are filled in."""
    err = refused(server.kube.create, llmservice("queued0", batching={"maxQueuedTokens": 0}))
    assert (err.status, err.reason) == (422, "Invalid") and "spec.batching.maxQueuedTokens" in err.message, err.message
    err = refused(server.kube.create, llmservice("queued-text", batching={"maxQueuedTokens": "many"}))
    assert err.status == 422 and "spec.batching.maxQueuedTokens" in err.message, err.message
    server.kube.create(llmservice("queued", batching={"maxQueuedTokens": 4096}))
    assert server.kube.get("LLMService", NS, "queued")["spec"]["batching"]["maxQueuedTokens"] == 4096
    server.kube.create(llmservice("unqueued", batching={"maxNumSeqs": 8}))
    batching = server.kube.get("LLMService", NS, "unqueued")["spec"]["batching"]
    assert "maxQueuedTokens" not in batching and batching["maxQueuedRequests"] == 256


def test_status_subresource(server):
    server.kube.create(llmservice("status"))
    server.kube.merge_patch("LLMService", NS, "status", {"status": {"replicas": 5}})  # main resource: ignored
    obj = server.kube.get("LLMService", NS, "status")
    assert "replicas" not in (obj.get("status") or {})
    server.kube.merge_patch("LLMService", NS, "status", {"status": {"replicas": 2}, "spec": {"replicas": 7}},
                            sub="status")  # the status subresource: only .status changes
    obj = server.kube.get("LLMService", NS, "status")
    assert obj["status"]["replicas"] == 2 and obj["spec"]["replicas"] == 1 and obj["metadata"]["generation"] == 1
    err = refused(server.kube.merge_patch, "ServiceAccount", NS, "default", {"status": {}}, "status")
    assert err.status == 404  # a kind without a status subresource


def test_scale_subresource(server):
    server.kube.create(llmservice("scaled"))
    server.kube.merge_patch("LLMService", NS, "scaled", {"status": {"replicas": 1, "selector": "a=b"}}, sub="status")
    scale = server.kube._call("GET", Kube.path("LLMService", NS, "scaled", "scale"))
    assert (scale["kind"], scale["spec"]["replicas"], scale["status"]) == ("Scale", 1, {"replicas": 1, "selector": "a=b"})
    server.kube.merge_patch("LLMService", NS, "scaled", {"spec": {"replicas": 3}}, sub="scale")  # kubectl scale
    obj = server.kube.get("LLMService", NS, "scaled")
    assert obj["spec"]["replicas"] == 3 and obj["metadata"]["generation"] == 2


def test_resource_version_conflicts(server):
    stale = server.kube.create(llmservice("versions"))
    server.kube.merge_patch("LLMService", NS, "versions", {"spec": {"replicas": 2}})
    rv = stale["metadata"]["resourceVersion"]
    err = refused(server.kube.merge_patch, "LLMService", NS, "versions",
                  {"metadata": {"resourceVersion": rv}, "spec": {"replicas": 3}})
    assert (err.status, err.reason) == (409, "Conflict")
    err = refused(server.kube._call, "PUT", Kube.path("LLMService", NS, "versions"), stale)
    assert (err.status, err.reason) == (409, "Conflict")
    fresh = server.kube.get("LLMService", NS, "versions")
    fresh["spec"]["replicas"] = 4
    assert server.kube._call("PUT", Kube.path("LLMService", NS, "versions"), fresh)["spec"]["replicas"] == 4
