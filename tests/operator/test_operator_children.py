"""Child manifests as pure functions of the CR: table-driven over replicas, ranks, quantization, sources."""
from __future__ import annotations

import copy

import kubernetes_validate
import pytest

from cpuserve.operator import naming
from cpuserve.engine.settings import ENGINE_HTTP_PORT, ENGINE_METRICS_PORT
from cpuserve.operator.children import build_children
from cpuserve.operator.memory import GIB, MIB, bytes_per_parameter, plan_memory
from cpuserve.operator.pods import MODEL_DIR, RAY_STOP_SECONDS
from cpuserve.operator.serve_document import serve_fields
from cpuserve.operator.spec import EMBEDDED_NUM_PARAMETERS
from cpuserve.operator.settings import OperatorSettings
from cpuserve.operator.validation import validate
from llmservice_factory import K8S_VERSION, make_body

SETTINGS = OperatorSettings()
PVC_MODEL = {"source": "pvc", "claimName": "models", "path": "llama-7b/model.gguf", "numParameters": 6_738_415_616,
             "checkpointType": "Q4_0"}
URL_MODEL = {"source": "url", "url": "https://example.invalid/m.tar.gz", "format": "safetensors",
             "numParameters": 1_000_000_000, "sha256": "a" * 64}
SECURITY = {"tlsSecretName": "tls", "apiKeys": {"name": "keys", "key": "keys.txt"}, "rayAuthTokenSecret": "raytok"}
DRAFT = {"method": "draft", "draft": {"path": "llama-7b/draft.gguf", "numParameters": 1_100_000_000, "weights": "int8",
                                      "kvCacheGb": 0.5}}


def children(body, with_sm=True):
    spec, findings = validate(body, SETTINGS)
    assert findings == []
    return build_children(body, spec, SETTINGS, with_sm)


def by_kind(manifests, kind):
    return [m for m in manifests if m["kind"] == kind]


CASES = [  # (spec, rank pod names)
    ({}, ["chat-g0-r0"]),
    ({"replicas": 0}, []),
    ({"replicas": 2, "ranksPerReplica": 2}, ["chat-g0-r0", "chat-g0-r1", "chat-g1-r0", "chat-g1-r1"]),
    ({"replicas": 1, "ranksPerReplica": 4, "model": PVC_MODEL}, [f"chat-g0-r{r}" for r in range(4)]),
    ({"replicas": 3, "model": URL_MODEL, "security": SECURITY}, ["chat-g0-r0", "chat-g1-r0", "chat-g2-r0"]),
    ({"ranksPerReplica": 2, "model": PVC_MODEL, "speculative": DRAFT}, ["chat-g0-r0", "chat-g0-r1"]),
]


@pytest.mark.parametrize("spec,ranks", CASES)
def test_pods_per_replica_group_and_rank(spec, ranks):
    manifests = children(make_body(**spec))
    pods = by_kind(manifests, "Pod")
    assert [p["metadata"]["name"] for p in pods] == ["chat-head"] + ranks
    for pod in pods[1:]:
        labels = pod["metadata"]["labels"]
        g, r = labels[naming.LABEL_GROUP], labels[naming.LABEL_RANK]
        assert pod["metadata"]["name"] == f"chat-g{g}-r{r}"
        assert labels[naming.LABEL_COMPONENT] == "rank" and labels[naming.LABEL_SERVICE] == "chat"
    assert [m["kind"] for m in manifests] == ["Service"] * 4 + ["Pod"] * len(pods) + ["PodDisruptionBudget", "NetworkPolicy",
                                                                                     "ServiceMonitor"]


@pytest.mark.parametrize("spec,_", CASES)
def test_every_manifest_is_valid_kubernetes(spec, _):
    for manifest in children(make_body(**spec), with_sm=False):
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


@pytest.mark.parametrize("spec,_", CASES)
def test_owner_reference_and_hash_on_every_child(spec, _):
    for m in children(make_body(**spec)):
        (owner,) = m["metadata"]["ownerReferences"]
        assert owner == {"apiVersion": "cpuserve.dev/v1alpha1", "kind": "LLMService", "name": "chat",
                         "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}
        assert m["metadata"]["namespace"] == "default"
        assert m["metadata"]["annotations"][naming.ANNOTATION_HASH] == naming.spec_hash(m)
        assert m["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "cpuserve-operator"


def test_spec_hash_is_stable_and_sensitive():
    a = children(make_body(replicas=2, quantization={"weights": "int8", "kvCache": "bf16"}))
    b = children(make_body(quantization={"kvCache": "bf16", "weights": "int8"}, replicas=2))  # other key order
    assert [naming.spec_hash(m) for m in a] == [naming.spec_hash(m) for m in b]
    c = children(make_body(replicas=2, quantization={"weights": "int4", "kvCache": "bf16"}))
    changed = {m["metadata"]["name"] for m, n in zip(a, c) if naming.spec_hash(m) != naming.spec_hash(n)}
    assert changed == {"chat-g0-r0", "chat-g1-r0"}  # weights change the rank pods' memory only


@pytest.mark.parametrize("weights,group,bpp", [("int4", 32, 0.75), ("int4", 128, 0.5625), ("int8", 32, 1.0),
                                               ("bf16", 32, 2.0), ("fp32", 128, 4.0)])
def test_memory_arithmetic(weights, group, bpp):
    body = make_body(model=PVC_MODEL, ranksPerReplica=2, quantization={"weights": weights, "groupSize": group},
                     resources={"kvCacheGb": 3, "overheadGb": 1.5, "cpusPerRank": 8})
    spec, _ = validate(body, SETTINGS)
    plan = plan_memory(spec)
    assert bytes_per_parameter(weights, group) == bpp
    shard = -(-int(6_738_415_616 * bpp) // 2)
    expected = -(-(shard + 3 * GIB + int(1.5 * GIB)) // MIB)
    assert plan.quantity == f"{expected}Mi"
    assert plan.weights_shard_bytes == pytest.approx(shard, abs=1)
    assert f"= {expected}Mi" in plan.arithmetic and f"x {bpp:g} B" in plan.arithmetic
    rank = by_kind(build_children(body, spec, SETTINGS, False), "Pod")[1]
    res = rank["spec"]["containers"][0]["resources"]
    assert res["requests"] == res["limits"] == {"cpu": "8", "memory": f"{expected}Mi"}  # Guaranteed QoS


def rank_memory(pods):
    """Each rank pod's memory request (= limit), by name."""
    out = {}
    for pod in pods[1:]:
        res = pod["spec"]["containers"][0]["resources"]
        assert res["requests"] == res["limits"]
        out[pod["metadata"]["name"]] = res["requests"]["memory"]
    return out


@pytest.mark.parametrize("speculative,draft_params,draft_bpp,draft_kv_gb", [
    (DRAFT, 1_100_000_000, 1.0, 0.5),  # its own weights (int8) and KV budget
    ({"method": "draft"}, EMBEDDED_NUM_PARAMETERS, 0.75, 0.25),  # the embedded SmolLM2 at the model's int4/g32
    ({"method": "draft", "draft": {"weights": "bf16", "kvCacheGb": 2}}, EMBEDDED_NUM_PARAMETERS, 2.0, 2.0),
])
def test_a_draft_model_adds_its_weights_and_kv_to_the_rank_0_pods(speculative, draft_params, draft_bpp, draft_kv_gb):
    """A replica group's engine, and so its draft model (whole, not sharded), runs on the group's rank-0 pod."""
    body = make_body(model=PVC_MODEL, replicas=2, ranksPerReplica=2, resources={"kvCacheGb": 3, "overheadGb": 1.5},
                     speculative=speculative)
    spec, _ = validate(body, SETTINGS)
    base = -(-int(6_738_415_616 * 0.75) // 2) + 3 * GIB + int(1.5 * GIB)  # rank 0's shard (int4/g32), KV, overhead
    draft = int(draft_params * draft_bpp) + int(draft_kv_gb * GIB)
    plan = plan_memory(spec)
    assert plan.draft_bytes == pytest.approx(draft, abs=1)
    assert plan.quantity == f"{-(-(base + draft) // MIB)}Mi"
    weights = f"+ draft {draft_params * draft_bpp / GIB:.3f} GiB ({draft_params} params x {draft_bpp:g} B"
    assert weights in plan.arithmetic
    assert f"+ draft KV {draft_kv_gb:.3f} GiB" in plan.arithmetic
    assert plan_memory(spec, rank=1).draft_bytes == 0 and "draft" not in plan_memory(spec, rank=1).arithmetic
    with_draft, without = f"{-(-(base + draft) // MIB)}Mi", f"{-(-base // MIB)}Mi"
    assert rank_memory(by_kind(children(body), "Pod")) == {"chat-g0-r0": with_draft, "chat-g0-r1": without,
                                                          "chat-g1-r0": with_draft, "chat-g1-r1": without}


@pytest.mark.parametrize("speculative", [None, {"method": "ngram"}, {"method": "ngram", "tokens": 8}])
def test_no_draft_model_no_memory(speculative):
    body = make_body(model=PVC_MODEL, **({"speculative": speculative} if speculative else {}))
    plan = plan_memory(validate(body, SETTINGS)[0])
    assert plan.draft_bytes == 0 and "draft" not in plan.arithmetic
    without = make_body(model=PVC_MODEL)
    assert rank_memory(by_kind(children(body), "Pod")) == rank_memory(by_kind(children(without), "Pod"))


def test_the_draft_model_is_read_from_the_models_claim_in_every_pod():
    """The head builds the apps (and checks the path); rank-0 pods run the engine: both mount the claim at MODEL_DIR,
    read-only, and the engine's args name the draft there."""
    body = make_body(model=PVC_MODEL, ranksPerReplica=2, speculative=DRAFT)
    spec, _ = validate(body, SETTINGS)
    path = serve_fields(spec)["spec_draft_model"]
    assert path == f"{MODEL_DIR}/llama-7b/draft.gguf"
    for pod in by_kind(children(body), "Pod"):
        (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "model"]
        assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        (mount,) = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "model"]
        assert mount["readOnly"] and path.startswith(mount["mountPath"] + "/")


def test_rank_pod_placement_and_ray_worker():
    spread = by_kind(children(make_body(replicas=1, ranksPerReplica=2, placement={"nodeSelector": {"pool": "llm"}})),
                     "Pod")[1]
    assert spread["spec"]["nodeSelector"] == {"cpuserve.dev/numa-pinning": "true", "pool": "llm"}
    term = spread["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["labelSelector"]["matchLabels"] == {naming.LABEL_SERVICE: "chat", naming.LABEL_GROUP: "0"}
    cmd = spread["spec"]["containers"][0]["command"]
    assert cmd[:3] == ["ray", "start", "--address=chat-head.chat-headless:6379"]
    assert '--resources={"cpuserve_socket": 1}' in cmd and "--num-cpus=2" in cmd and "--include-log-monitor=false" in cmd
    pack = by_kind(children(make_body(ranksPerReplica=2, placement={"mode": "pack"})), "Pod")[1]
    assert "podAffinity" in pack["spec"]["affinity"] and "podAntiAffinity" not in pack["spec"]["affinity"]


def test_pods_are_locked_down():
    for pod in by_kind(children(make_body(model=URL_MODEL, security=SECURITY)), "Pod"):
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["automountServiceAccountToken"] is False
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] and not sc["privileged"] and not sc["allowPrivilegeEscalation"]
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert c["resources"]["requests"] == c["resources"]["limits"]
        env = {e["name"]: e for e in spec["containers"][0]["env"]}
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "raytok", "key": "token"}


def test_head_runs_only_ray_and_is_untouched_by_serving_changes():
    body = make_body(model=URL_MODEL, security=SECURITY, replicas=2, ranksPerReplica=2)
    spec, _ = validate(body, SETTINGS)
    head = by_kind(build_children(body, spec, SETTINGS, False), "Pod")[0]
    cmd = head["spec"]["containers"][0]["command"]
    assert cmd[:3] == ["ray", "start", "--head"] and "--dashboard-port=8265" in cmd and cmd[-1] == "--block"
    assert {"--include-log-monitor=false", "--no-monitor"} <= set(cmd)  # no one reads either (operator/pods.py)
    assert "args" not in head["spec"]["containers"][0], "the Serve app comes through the REST API"
    init = head["spec"]["initContainers"][0]
    assert init["command"][3:] == ["--url", URL_MODEL["url"], "--dest", "/models/model", "--sha256", "a" * 64]
    assert head["spec"]["containers"][0]["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert head["spec"]["containers"][0]["readinessProbe"]["timeoutSeconds"] == 10  # the probe does real work


def test_pods_drain_on_stop_as_cpuserve_serve_does():
    """preStop: the head drains (new requests refused, running ones finish), each rank pod waits for the running ones
    without refusing; the grace period is drainTimeoutSeconds plus the time Ray takes to stop."""
    for spec, timeout in (({}, 30), ({"drainTimeoutSeconds": 120}, 120), ({"drainTimeoutSeconds": 0}, 0)):
        head, *ranks = by_kind(children(make_body(replicas=1, ranksPerReplica=2, **spec)), "Pod")
        assert head["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == [
            "cpuserve", "drain", f"--timeout-s={timeout}"]
        for rank in ranks:
            assert rank["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == [
                "cpuserve", "drain", f"--timeout-s={timeout}", "--wait-only"]
        for pod in (head, *ranks):
            assert pod["spec"]["terminationGracePeriodSeconds"] == timeout + RAY_STOP_SECONDS


def pod_hashes(**spec):
    return {m["metadata"]["name"]: naming.spec_hash(m) for m in children(make_body(**spec)) if m["kind"] == "Pod"}


@pytest.mark.parametrize("change,restarted", [
    ({"replicas": 3}, {"chat-g2-r0"}),  # a new group only: the head and groups 0-1 stay
    ({"replicas": 1}, set()),  # group 1 goes; nothing else changes
    # the engine's args: a new revision, the replicas roll onto new rank pods with a surge (rollout.py); not the head
    ({"batching": {"maxNumSeqs": 8, "maxQueuedRequests": 16}}, {"chat-g0-r0", "chat-g1-r0"}),
    ({"batching": {"maxQueuedTokens": 4096}}, {"chat-g0-r0", "chat-g1-r0"}),  # LLMServer enforces it
    ({"quantization": {"weights": "int8"}}, {"chat-g0-r0", "chat-g1-r0"}),  # rank memory changes too
    ({"resources": {"headCpus": 2}}, {"chat-head"}),
])
def test_only_pods_whose_own_spec_changed_restart(change, restarted):
    before, after = pod_hashes(replicas=2), pod_hashes(**{"replicas": 2, **change})
    assert {n for n in after if before.get(n) != after[n]} == restarted


def test_services_and_pdb():
    manifests = children(make_body(ports={"grpc": 9100, "http": 8100, "metrics": 8180, "engineMetrics": 8181}))
    svc = {m["metadata"]["name"]: m for m in by_kind(manifests, "Service")}
    assert [(p["name"], p["port"]) for p in svc["chat"]["spec"]["ports"]] == [("grpc", 9100), ("http", 8100)]
    assert svc["chat"]["spec"]["selector"] == {naming.LABEL_SERVICE: "chat", naming.LABEL_COMPONENT: "head"}
    assert svc["chat-headless"]["spec"]["clusterIP"] == "None"
    assert svc["chat-metrics"]["spec"]["ports"][0]["port"] == 8180
    # every rank pod's own engine gauges, on the port its pods declare and name in their environment
    engine = svc["chat-engine-metrics"]
    assert engine["spec"]["selector"] == {naming.LABEL_SERVICE: "chat", naming.LABEL_COMPONENT: "rank"}
    assert [(p["name"], p["port"], p["targetPort"]) for p in engine["spec"]["ports"]] == [
        ("engine-metrics", 8181, "engine-metrics")]
    assert engine["metadata"]["labels"][naming.LABEL_COMPONENT] == "metrics"  # the ServiceMonitor selects it
    (sm,) = by_kind(manifests, "ServiceMonitor")
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics", "engine-metrics"]
    for pod in by_kind(manifests, "Pod")[1:]:
        (c,) = pod["spec"]["containers"]
        assert {"name": "engine-metrics", "containerPort": 8181} in c["ports"]
        assert {"name": ENGINE_METRICS_PORT.name, "value": "8181"} in c["env"]
    (pdb,) = by_kind(manifests, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert by_kind(children(make_body(), with_sm=False), "ServiceMonitor") == []


def test_builders_do_not_mutate_the_body():
    body = make_body(replicas=2)
    before = copy.deepcopy(body)
    children(body)
    assert body == before


def test_every_pod_starts_ray_with_the_settings_cpuserve_serve_uses():
    # Ray reads these when its processes start, so a started cluster must carry what `cpuserve serve` sets for a
    # local one: worker niceness 0, Serve's gRPC data plane, the slower control loop
    from cpuserve.serving.ray_env import RAY_ENV

    pods = by_kind(children(make_body(ranksPerReplica=2)), "Pod")
    assert len(pods) >= 2  # the head and the rank pods
    for pod in pods:
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert {k: env.get(k) for k in RAY_ENV} == RAY_ENV, pod["metadata"]["name"]


@pytest.mark.parametrize("security,scheme", [({}, "HTTP"), (SECURITY, "HTTPS")])
def test_rank0_pods_serve_their_engines_openai_api_on_the_http_port(security, scheme):
    """A group's engine runs on its rank-0 pod (its Ray node's rank label: serving/app.py), which declares the
    LLMService's HTTP port, names it to the replica (CPUSERVE_ENGINE_HTTP_PORT) and is ready while its /health
    answers: what an InferencePool selects and its gateway sends to. The other ranks open no HTTP port."""
    body = make_body(replicas=2, ranksPerReplica=2, security=security,
                     ports={"grpc": 9100, "http": 8100, "metrics": 8180, "engineMetrics": 8181})
    for pod in by_kind(children(body), "Pod")[1:]:
        (c,) = pod["spec"]["containers"]
        rank = pod["metadata"]["labels"][naming.LABEL_RANK]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert f"{naming.LABEL_RANK}={rank}" in next(a for a in c["command"] if a.startswith("--labels="))
        if rank == "0":
            assert {"name": "http", "containerPort": 8100} in c["ports"] and env[ENGINE_HTTP_PORT.name] == "8100"
            assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": scheme}
        else:
            assert "http" not in {p["name"] for p in c["ports"]} and ENGINE_HTTP_PORT.name not in env
            assert c["readinessProbe"]["httpGet"]["port"] == "agent"
        # the keys and certificate its API serves with (serve_document.engine_args names their paths)
        mounts = {m["name"] for m in c["volumeMounts"]}
        assert {"api-keys", "tls"} <= mounts if security else not {"api-keys", "tls"} & mounts
