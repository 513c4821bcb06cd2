"""The real operator process (`python -m cpuserve.operator`) against a fake API server on 127.0.0.1:
create, scale, model change, drift repair, delete, invalid spec; then its metrics endpoint."""
from __future__ import annotations

import base64
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from control_plane import OperatorProcess, free_port, wait_for, write_kubeconfig
from fake_apiserver import FakeApiServer

ROOT = Path(__file__).resolve().parents[2]
NS = "serving"
FRESH = "fresh"  # a namespace whose "default" ServiceAccount does not exist yet
LLMS = "llmservices"
RESYNC_SECONDS = 1.5
RETRY_BASE_SECONDS = 0.4
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(fake API server, operator metrics port, liveness port); the operator runs for the whole module."""
    tmp = tmp_path_factory.mktemp("operator")
    api = FakeApiServer().start()
    api.create("serviceaccounts", NS, {"metadata": {"name": "default"}})  # what the controller manager makes
    kubeconfig = write_kubeconfig(tmp / "kubeconfig", f"http://127.0.0.1:{api.port}", NS)
    metrics_port, liveness_port = free_port(), free_port()
    operator = OperatorProcess(kubeconfig, [NS, FRESH], tmp / "operator.log", liveness_port,
                               resync_seconds=RESYNC_SECONDS, metrics_port=metrics_port, image="cpuserve:test",
                               retry_base_seconds=RETRY_BASE_SECONDS, retry_max_seconds=5,
                               # no Ray runs in this fake cluster: the heads' dashboards are a port nobody listens
                               # on (the Serve REST API on a real Ray head: test_serve_inplace.py, test_e2e_local.py)
                               dashboard_url=f"http://127.0.0.1:{free_port()}")
    failed = True
    try:
        wait_for("the operator to watch LLMServices",
                 lambda: any(m == "GET" and p.endswith(f"/namespaces/{NS}/{LLMS}") for m, p, _ in api.requests), 30)
        yield api, metrics_port, liveness_port
        failed = False
    finally:
        operator.stop(show_log=failed)
        api.stop()


def llmservice(name: str, **spec) -> dict:
    spec.setdefault("model", {"source": "embedded"})
    return {"apiVersion": "cpuserve.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": name}, "spec": spec}


def children(api: FakeApiServer, name: str, ns: str = NS) -> dict[str, list[str]]:
    out = {}
    for plural in ("pods", "services", "poddisruptionbudgets", "servicemonitors"):
        objs = [api.get(plural, ns, n) for n in api.names(plural, ns)]
        out[plural] = [o["metadata"]["name"] for o in objs
                       if o and (o["metadata"].get("labels") or {}).get("cpuserve.dev/llmservice") == name]
    return out


def condition(api: FakeApiServer, name: str, ctype: str, ns: str = NS) -> dict:
    obj = api.get(LLMS, ns, name) or {}
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})


def set_ready(api: FakeApiServer, pod: str) -> None:
    """What the kubelet would report."""
    api.patch("pods", NS, pod, {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
              sub="status")


def pod_hash(api, pod):
    obj = api.get("pods", NS, pod)
    return obj and obj["metadata"]["annotations"]["cpuserve.dev/spec-hash"]


def test_create_then_ready(cluster):
    api, *_ = cluster
    cr = api.create(LLMS, NS, llmservice("alpha", replicas=1, ranksPerReplica=2))
    pods = ["alpha-g0-r0", "alpha-g0-r1", "alpha-head"]
    got = wait_for("children", lambda: (c := children(api, "alpha"))["pods"] == pods and c)
    assert got == {"pods": pods, "services": ["alpha", "alpha-engine-metrics", "alpha-headless", "alpha-metrics"],
                   "poddisruptionbudgets": ["alpha"], "servicemonitors": ["alpha"]}
    for pod in pods:
        (owner,) = api.get("pods", NS, pod)["metadata"]["ownerReferences"]
        assert owner["uid"] == cr["metadata"]["uid"] and owner["controller"] is True
    secret, policy = api.get("secrets", NS, "alpha-ray-token"), api.get("networkpolicies", NS, "alpha-ray")
    assert len(base64.b64decode(secret["data"]["token"])) >= 32, "a generated Ray token, created before the pods"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == cr["metadata"]["uid"]
    assert policy["spec"]["podSelector"] == {"matchLabels": {"cpuserve.dev/llmservice": "alpha"}}
    assert wait_for("Ready=False", lambda: condition(api, "alpha", "Ready").get("reason") == "HeadNotReady")
    status = api.get(LLMS, NS, "alpha")["status"]
    assert status["observedGeneration"] == 1 and status["memoryPerRank"].endswith("Mi")
    assert status["endpoints"]["grpc"] == f"alpha.{NS}.svc:9000"
    assert "cpuserve.dev/finalizer" in api.get(LLMS, NS, "alpha")["metadata"]["finalizers"]
    for pod in pods:
        set_ready(api, pod)
    wait_for("Ready=True", lambda: condition(api, "alpha", "Ready").get("status") == "True")
    assert api.get(LLMS, NS, "alpha")["status"]["readyReplicas"] == 1


def uid(api, pod):
    return api.get("pods", NS, pod)["metadata"]["uid"]


def test_scale_up_and_down(cluster):
    api, *_ = cluster
    api.create(LLMS, NS, llmservice("beta"))
    wait_for("one rank", lambda: children(api, "beta")["pods"] == ["beta-g0-r0", "beta-head"])
    first_rank_uid, head_uid = uid(api, "beta-g0-r0"), uid(api, "beta-head")
    api.patch(LLMS, NS, "beta", {"spec": {"replicas": 3}}, sub="scale")  # kubectl scale
    wait_for("three ranks", lambda: children(api, "beta")["pods"] == ["beta-g0-r0", "beta-g1-r0", "beta-g2-r0",
                                                                      "beta-head"])
    api.patch(LLMS, NS, "beta", {"spec": {"replicas": 1}})
    wait_for("back to one", lambda: children(api, "beta")["pods"] == ["beta-g0-r0", "beta-head"])
    wait_for("status.replicas", lambda: api.get(LLMS, NS, "beta")["status"]["replicas"] == 1)
    assert uid(api, "beta-g0-r0") == first_rank_uid, "a surviving group is not touched"
    assert uid(api, "beta-head") == head_uid, "the head (the Ray cluster) stays: the Serve config changes in place"


def test_batching_change_restarts_no_pod(cluster):
    api, *_ = cluster
    api.create(LLMS, NS, llmservice("theta", replicas=2))
    pods = ["theta-g0-r0", "theta-g1-r0", "theta-head"]
    wait_for("pods", lambda: children(api, "theta")["pods"] == pods)
    set_ready(api, "theta-head")  # a running head: the operator turns to its Serve REST API
    uids = {p: uid(api, p) for p in pods}
    api.patch(LLMS, NS, "theta", {"spec": {"batching": {"maxNumSeqs": 8}}})
    cond = wait_for("the Serve config pending", lambda: (c := condition(api, "theta", "Progressing")).get(
        "reason") == "ServeConfigPending" and c["observedGeneration"] == 2 and c)
    assert "/api/serve/applications/" in cond["message"]  # what it tries: Ray Serve's REST API on the head
    # the new replicas' rank pods (a surge group) come beside the serving ones, which stay
    wait_for("a surge group", lambda: children(api, "theta")["pods"] == [*pods[:2], "theta-g2-r0", "theta-head"])
    assert {p: uid(api, p) for p in pods} == uids


def test_model_change_adds_a_group_and_keeps_the_old_ones_while_their_use_is_unknown(cluster):
    """The rank pods' revision changes: one group of the new revision more (a surge), the old groups stay while
    the head cannot say which pods run Ray actors (no Ray here; rollout.py and test_e2e_local.py for the rest)."""
    api, *_ = cluster
    api.create(LLMS, NS, llmservice("gamma", replicas=2))
    pods = ["gamma-g0-r0", "gamma-g1-r0", "gamma-head"]
    wait_for("pods", lambda: children(api, "gamma")["pods"] == pods)
    for pod in pods:
        set_ready(api, pod)  # a running head: the operator asks its Ray which pods are busy (no answer here)
    uids = {p: uid(api, p) for p in pods}
    revision = api.get("pods", NS, "gamma-g0-r0")["metadata"]["labels"]["cpuserve.dev/revision"]
    token = api.get("secrets", NS, "gamma-ray-token")["data"]
    api.patch(LLMS, NS, "gamma", {"spec": {"quantization": {"weights": "int8"}}})  # rank memory changes
    wait_for("a surge group", lambda: children(api, "gamma")["pods"] == [*pods[:2], "gamma-g2-r0", "gamma-head"])
    new = api.get("pods", NS, "gamma-g2-r0")
    assert new["metadata"]["labels"]["cpuserve.dev/revision"] != revision
    command = new["spec"]["containers"][0]["command"]
    assert "--node-name=gamma-g2-r0" in command
    # its Ray node: the revision Serve places replicas by, and the rank a group's engine goes by (rank 0)
    assert f"--labels=cpuserve.dev/revision={new['metadata']['labels']['cpuserve.dev/revision']},cpuserve.dev/rank=0" \
        in command
    # the old groups serve until the new one takes over: the service stays Ready, and says it is rolling
    wait_for("observedGeneration 2", lambda: api.get(LLMS, NS, "gamma")["status"]["observedGeneration"] == 2)
    assert api.get(LLMS, NS, "gamma")["status"]["readyReplicas"] == 2
    assert (condition(api, "gamma", "Ready")["status"], condition(api, "gamma", "Progressing")["status"]) == \
        ("True", "True")
    set_ready(api, "gamma-g2-r0")
    time.sleep(RESYNC_SECONDS * 1.5)  # a timer pass or more
    assert children(api, "gamma")["pods"] == [*pods[:2], "gamma-g2-r0", "gamma-head"], "one group more at most"
    assert {p: uid(api, p) for p in pods} == uids, "no pod goes while a replica may run on it; the head stays"
    wait_for("observedGeneration 2", lambda: api.get(LLMS, NS, "gamma")["status"]["observedGeneration"] == 2)
    assert condition(api, "gamma", "Progressing")["status"] == "True"
    assert api.get("secrets", NS, "gamma-ray-token")["data"] == token, "the token outlives pod restarts"


def test_drift_repair(cluster):
    api, *_ = cluster
    api.create(LLMS, NS, llmservice("delta"))
    wait_for("pods", lambda: pod_hash(api, "delta-g0-r0"))
    api.delete("pods", NS, "delta-g0-r0")  # a pod event: repaired at once
    wait_for("rank recreated", lambda: pod_hash(api, "delta-g0-r0"))
    api.patch("services", NS, "delta", {"spec": {"ports": [{"name": "http", "port": 1234}]},
                                        "metadata": {"annotations": {"cpuserve.dev/spec-hash": "edited"}}})
    wait_for("Service repaired by the timer", lambda: [p["port"] for p in api.get("services", NS, "delta")["spec"]["ports"]]
             == [9000, 8000], timeout=RESYNC_SECONDS * 6)


def test_delete_removes_everything(cluster):
    api, *_ = cluster
    api.create(LLMS, NS, llmservice("epsilon", replicas=2))
    wait_for("children", lambda: len(children(api, "epsilon")["pods"]) == 3)
    api.delete(LLMS, NS, "epsilon")
    wait_for("LLMService gone", lambda: api.get(LLMS, NS, "epsilon") is None)
    assert children(api, "epsilon") == {"pods": [], "services": [], "poddisruptionbudgets": [], "servicemonitors": []}


def test_invalid_spec_condition_event_and_no_retry_storm(cluster):
    api, *_ = cluster
    api.create(LLMS, NS, llmservice("zeta", resources={"kvCacheGb": 64, "memoryPerRankGb": 8}))
    cond = wait_for("ValidationFailed", lambda: (c := condition(api, "zeta", "ValidationFailed")).get("status") == "True" and c)
    assert cond["reason"] == "InvalidSpec" and "spec.resources.kvCacheGb" in cond["message"]
    assert condition(api, "zeta", "Ready")["status"] == "False"

    wait_for("the Event", lambda: events(api, NS, "zeta", "ValidationFailed"))
    patches = lambda: sum(m == "PATCH" and "/llmservices/zeta" in p for m, p, _ in api.requests)  # noqa: E731
    settled = patches()
    time.sleep(RESYNC_SECONDS * 3)  # at least two timer passes
    assert len(events(api, NS, "zeta", "ValidationFailed")) == 1, "one Event per invalid generation"
    assert patches() - settled <= 1, "the status is not rewritten on every pass"
    assert children(api, "zeta")["pods"] == []
    api.patch(LLMS, NS, "zeta", {"spec": {"resources": {"memoryPerRankGb": 80}}})  # fixed
    wait_for("valid again", lambda: condition(api, "zeta", "ValidationFailed").get("status") == "False")
    wait_for("pods after the fix", lambda: children(api, "zeta")["pods"] == ["zeta-g0-r0", "zeta-head"])


def events(api: FakeApiServer, ns: str, name: str, reason: str) -> list[dict]:
    objs = [api.get("events", ns, n) for n in api.names("events", ns)]
    return [e for e in objs if e and e["involvedObject"].get("name") == name and e["reason"] == reason]


def test_refused_children_show_in_the_status_with_one_event_and_backoff(cluster):
    """What the real server did: pods refused (403) while the namespace's service account did not exist."""
    api, *_ = cluster
    api.create(LLMS, FRESH, llmservice("eta"))
    degraded = wait_for("Degraded", lambda: (c := condition(api, "eta", "Degraded", FRESH)).get("status") == "True" and c)
    assert degraded["reason"] == "Forbidden"  # the API's own reason and message
    assert degraded["message"].startswith('create Pod eta-head: pods "eta-head" is forbidden: error looking up '
                                          f'service account {FRESH}/default: serviceaccount "default" not found')
    assert "(and 1 more refused child writes)" in degraded["message"]  # eta-g0-r0
    progressing = condition(api, "eta", "Progressing", FRESH)
    assert (progressing["status"], progressing["reason"]) == ("True", "Forbidden")
    assert condition(api, "eta", "Ready", FRESH)["status"] == "False"
    assert children(api, "eta", FRESH)["services"] == ["eta", "eta-engine-metrics", "eta-headless", "eta-metrics"], \
        "the rest goes on"
    posts = lambda: [t for (m, p, _), t in zip(api.requests, api.request_times)  # noqa: E731
                     if m == "POST" and p.endswith(f"/namespaces/{FRESH}/pods")]
    def passes():  # the two pods' POSTs of one pass come together
        times = posts()
        return [t for i, t in enumerate(times) if i == 0 or t - times[i - 1] > 0.2]
    wait_for("three retries", lambda: len(passes()) >= 4, timeout=30)
    tries = passes()
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert all(later > 1.3 * earlier for earlier, later in zip(gaps, gaps[1:])), f"no backoff: gaps {gaps}"
    assert gaps[0] >= RETRY_BASE_SECONDS * 0.9, gaps
    assert len(events(api, FRESH, "eta", "Forbidden")) == 1, "one Event per distinct refusal, not one per retry"
    api.create("serviceaccounts", FRESH, {"metadata": {"name": "default"}})
    wait_for("pods once the service account exists", lambda: children(api, "eta", FRESH)["pods"] == ["eta-g0-r0",
                                                                                                    "eta-head"])
    wait_for("Degraded cleared", lambda: condition(api, "eta", "Degraded", FRESH).get("status") == "False")


def test_operator_metrics_and_liveness(cluster):
    _, port, liveness_port = cluster
    with urllib.request.urlopen(f"http://127.0.0.1:{liveness_port}/healthz", timeout=5) as rsp:
        assert rsp.status == 200  # the chart's livenessProbe
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("cpuserve_operator_")}
    assert samples['cpuserve_operator_reconciles_total{result="success"}'] >= 6
    assert samples['cpuserve_operator_reconciles_total{result="invalid"}'] >= 1
    assert samples["cpuserve_operator_reconcile_duration_seconds_count"] >= 7
    assert samples['cpuserve_operator_managed_llmservices{condition="Ready"}'] >= 1  # alpha
    assert "cpuserve_operator_errors_total" in samples


def required_permissions(requests) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of every resource request the operator made; discovery needs no RBAC."""
    out = set()
    for method, path, query in requests:
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "v1"] and len(parts) > 2:
            group, rest = "", parts[2:]
        elif parts[:1] == ["apis"] and len(parts) > 3:
            group, rest = parts[1], parts[3:]
        else:
            continue  # /version, /api, /apis, /apis/GROUP/VERSION
        if rest[:1] == ["namespaces"] and len(rest) >= 3:
            rest = rest[2:]
        resource = "/".join([rest[0]] + rest[2:3])
        if method == "GET":
            verb = "get" if len(rest) > 1 else ("watch" if query.get("watch") in ("true", "1") else "list")
        else:
            verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method]
        out.add((group, resource, verb))
    return out


def test_the_chart_rbac_grants_every_request_the_operator_made(cluster):
    """Least privilege both ways: the operator needs nothing the chart does not grant."""
    api, *_ = cluster
    helm = ROOT / "tools" / "helm"
    if not helm.exists():
        pytest.skip("helm not found: run `make tools`")
    rendered = subprocess.run([str(helm), "template", "rel", str(ROOT / "charts" / "cpuserve"),
                               "--show-only", "templates/rbac.yaml"], capture_output=True, text=True, check=True)
    (role,) = [d for d in yaml.safe_load_all(rendered.stdout) if d and d["kind"] == "ClusterRole"]
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    needed = required_permissions(api.requests)
    assert ("cpuserve.dev", "llmservices", "watch") in needed
    assert needed - granted == set(), sorted(needed)
