"""kubectl apply -> tokens: the example LLMService goes through the real operator and a fake API server, and the
pods it creates run as local processes (local_kubelet.py): their own commands, env and ports make a Ray
cluster, the operator applies the Serve app through the head's REST API, a gRPC Generate through the head's
port streams tokens. Under 8 streams on a batch of 2, the rank pod's own queue gauge crosses the chart's HPA
target, the HPA's rule asks for 2 replicas, and that scale (through the scale subresource, as the HPA writes it)
is served without dropping a stream; then each rank pod's own HTTP port answers the OpenAI API from its own engine,
as an InferencePool's gateway reaches it. Back at 1 replica, the weights' format changes: a rank pod of the new revision
starts beside the old one, Serve starts the new replica there before the old one drains and stops, the operator
then removes the old pod; 8 streams and a probe every 0.2 s are served throughout, the ingress is never replaced.

No HPA controller or custom-metrics adapter runs here: the test reads the gauges the adapter would serve from the
pod's endpoint and applies the HPA controller's documented rule (hpa_desired_replicas) to the HPA the chart renders
for this LLMService. Everything after that decision is the real operator, Serve and engines."""
from __future__ import annotations

import math
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from control_plane import (OperatorProcess, RealControlPlane, assets_missing, free_port, kubectl, start_fake,
                           wait_for)
from cpuserve.operator.serve_api import ServeApi, read_token
from cpuserve.operator.validation import validate
from cpuserve.operator.settings import OperatorSettings
from cpuserve.operator.spec import PortsSpec
from cpuserve.serving.config import DEFAULT_MODEL_NAME
from cpuserve.serving.names import ENGINE_APP_NAME
from cpuserve.v1 import inference_pb2 as pb
from cpuserve.v1 import inference_pb2_grpc as pbg
from fake_apiserver import CHART_CRDS
from local_kubelet import LocalKubelet
from serve_load import change_under_load, running

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "charts"))
from chart_tools import render  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
NS, NAME, NUM_TOKENS, MAX_NUM_SEQS, NUM_STREAMS = "ml", "smollm2", 64, 2, 8
# The 8 streams' length: the first pair decodes while 6 wait, and that window must outlast a poll of the gauges on
# a busy 2-core runner (at 64 tokens it was under a second, and CI missed it).
STREAM_TOKENS = 256
EXAMPLE = CHART_CRDS.parent / "examples" / "llmservice-smollm2.yaml"


@pytest.fixture(scope="module", params=["fake", "real"])
def cluster(request, tmp_path_factory):
    """The API server (the fake, or a real control plane from KUBEBUILDER_ASSETS), the kubelet, the operator."""
    if request.param == "real" and (why := assets_missing()):
        pytest.skip(f"real control plane: {why}")
    tmp = tmp_path_factory.mktemp("e2e")
    plane = RealControlPlane() if request.param == "real" else None
    server = plane.start() if plane else start_fake(tmp)
    server.create_namespace(NS)
    kubelet = LocalKubelet(server.kube, NS, NAME, tmp)
    operator = OperatorProcess(server.kubeconfig, [NS], tmp / "operator.log", free_port(), metrics_port=0,
                               resync_seconds=5, retry_base_seconds=1, retry_max_seconds=5,
                               dashboard_url=f"http://127.0.0.1:{kubelet.head_ports[8265]}")
    kubelet.start()
    failed = True
    try:
        yield server, kubelet
        failed = False
    finally:
        operator.stop(show_log=failed)
        kubelet.stop()
        plane.stop() if plane else server.fake.stop()


def the_example(ports: dict[str, int]) -> dict:
    """charts/cpuserve/examples/llmservice-smollm2.yaml, on free ports and sized for this 2-core machine."""
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"]["namespace"] = NS
    body["spec"]["ports"] = ports
    body["spec"]["resources"].update(cpusPerRank=1, kvCacheGb=0.1)
    body["spec"]["batching"]["maxNumSeqs"] = MAX_NUM_SEQS  # so that 8 streams queue past the HPA's target
    return body


def chart_hpa() -> dict:
    """The HPA the chart renders (real helm, default thresholds) for this LLMService."""
    (hpa,) = [d for d in render("--set", "autoscaling.enabled=true", "--set", f"autoscaling.llmServices[0].name={NAME}",
                                "--set", f"autoscaling.llmServices[0].namespace={NS}")
              if d["kind"] == "HorizontalPodAutoscaler"]
    return hpa


def hpa_desired_replicas(hpa: dict, current: int, averages: dict[str, float]) -> int:
    """The HPA controller's rule for Pods metrics with AverageValue targets (Kubernetes docs, "Horizontal Pod
    Autoscaling", algorithm details): per metric ceil(current * average / target), unchanged within the 10%
    tolerance; the largest wins; bounded by min/maxReplicas and by the scale-up policy (Pods: value per period)."""
    wanted = []
    for metric in hpa["spec"]["metrics"]:
        ratio = averages[metric["pods"]["metric"]["name"]] / float(metric["pods"]["target"]["averageValue"])
        wanted.append(current if abs(ratio - 1) <= 0.1 else math.ceil(current * ratio))
    desired = max(hpa["spec"]["minReplicas"], min(hpa["spec"]["maxReplicas"], max(wanted)))
    (policy,) = hpa["spec"]["behavior"]["scaleUp"]["policies"]
    return min(desired, current + policy["value"])


def condition(server, ctype: str) -> dict:
    obj = server.kube.get("LLMService", NS, NAME) or {}
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})


def generate(port: int, i: int, out: dict, done: dict | None = None, tokens: int = NUM_TOKENS) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        req = pb.GenerateRequest(text=f"Tell story {i}.", sampling=pb.SamplingParameters(
            max_tokens=tokens, temperature=0, ignore_eos=True))
        try:
            out[i] = [rsp for rsp in pbg.InferenceStub(channel).Generate(req, timeout=600)]
        except grpc.RpcError as err:
            out[i] = f"{err.code()}: {err.details()}"
    if done is not None:
        done[i] = time.monotonic()


def engine_gauges(kubelet: LocalKubelet, pod: str) -> dict[str, float]:
    """The vLLM-named gauges of a rank pod's engine-metrics port (spec.ports.engineMetrics, mapped to this host) as
    {name: value}, samples labelled with the served model. (The port's `cpuserve_*` request metrics, of the requests
    on the pod's own API, are serving/test_engine_metrics_protocol.py's.)"""
    port = kubelet.procs[pod][1][PortsSpec().engine_metrics]
    text = wait_for(f"{pod}'s engine metrics", lambda: _get(f"http://127.0.0.1:{port}/metrics"), timeout=60)
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == family.name and family.type == "gauge" and family.name.startswith("vllm:"):
                assert sample.labels["model_name"] == DEFAULT_MODEL_NAME, sample
                out[sample.name] = sample.value
    return out


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as rsp:
            return rsp.read().decode()
    except OSError:
        return None


def test_kubectl_apply_to_tokens_then_scale(cluster):
    server, kubelet = cluster
    ports = {"grpc": free_port(), "http": free_port(), "metrics": free_port()}
    body = the_example(ports)
    assert validate({**body, "metadata": {**body["metadata"], "uid": "x"}}, OperatorSettings())[1] == []
    if server.name == "real":
        result = kubectl(server, "apply", "-f", "-", stdin=yaml.safe_dump(body))
        assert result.returncode == 0, result.stderr
    else:
        server.kube.create(body)  # what `kubectl apply` sends (kubectl validates strictly too)
    wait_for("Ready", lambda: condition(server, "Ready").get("status") == "True", timeout=480, interval=1)
    assert set(kubelet.ready) == {f"{NAME}-head", f"{NAME}-g0-r0"} and not kubelet.exited

    out: dict[int, object] = {}
    generate(ports["grpc"], 0, out)  # one stream through the head's gRPC port
    assert isinstance(out[0], list), out[0]
    assert sum(len(m.token_ids) for m in out[0]) == NUM_TOKENS and out[0][-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert "".join(m.text for m in out[0]).strip()
    assert engine_gauges(kubelet, f"{NAME}-g0-r0")["vllm:num_requests_running"] == 0  # the rank pod's own endpoint

    hpa = chart_hpa()  # what the HPA controller would decide from the pod's gauges
    done: dict[int, float] = {}
    streams = [threading.Thread(target=generate, args=(ports["grpc"], i, out, done, STREAM_TOKENS))
               for i in range(1, NUM_STREAMS + 1)]
    for t in streams:
        t.start()
    desired = wait_for("the HPA's rule to ask for more", lambda: (
        d := hpa_desired_replicas(hpa, 1, engine_gauges(kubelet, f"{NAME}-g0-r0"))) > 1 and d, timeout=60)
    assert desired == 2, "one group more: the chart's scale-up policy adds one at a time"
    scaled_at = time.monotonic()
    if server.name == "real":
        result = kubectl(server, "scale", "llmservice", NAME, "-n", NS, f"--replicas={desired}")
        assert result.returncode == 0, result.stderr
    else:  # what the HPA writes (and `kubectl scale` sends): the scale subresource
        server.kube.merge_patch("LLMService", NS, NAME, {"spec": {"replicas": desired}}, sub="scale")
    wait_for("the second group's pod", lambda: f"{NAME}-g1-r0" in kubelet.ready, timeout=120, interval=1)
    token = read_token(server.kube, NS, NAME, validate(server.kube.get("LLMService", NS, NAME), OperatorSettings())[0])
    api = ServeApi(f"http://127.0.0.1:{kubelet.head_ports[8265]}", token)
    wait_for("2 LLMServer replicas", lambda: running(api, 2), timeout=420, interval=1)
    with grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}") as channel:  # the ingress was told, not restarted
        (model,) = pbg.InferenceStub(channel).ListModels(pb.ListModelsRequest(), timeout=30).models
    assert model.replicas == 2
    for t in streams:
        t.join(600)
    for i in range(1, NUM_STREAMS + 1):
        assert isinstance(out[i], list), out[i]
        assert sum(len(m.token_ids) for m in out[i]) == STREAM_TOKENS, i
        assert done[i] > scaled_at, "the stream ran across the scale"
    wait_for("readyReplicas 2", lambda: server.kube.get("LLMService", NS, NAME)["status"]["readyReplicas"] == 2)
    replicas = set()
    for pod in (f"{NAME}-g0-r0", f"{NAME}-g1-r0"):  # each model server (pod) has its own engine's gauges
        assert set(engine_gauges(kubelet, pod)) >= {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
        replicas.add(ask_pod(kubelet, pod, ports["http"]))
    assert len(replicas) == 2, "each pod's own HTTP port reaches its own engine (an InferencePool's target port)"
    assert not kubelet.exited, kubelet.exited


def ask_pod(kubelet: LocalKubelet, pod: str, http_port: int) -> str:
    """A chat completion on a rank pod's own `http` port (the LLMService's spec.ports.http, mapped to this host),
    where an InferencePool's gateway sends it, with the official client; returns the replica that answered."""
    port = kubelet.procs[pod][1][http_port]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
    answer = raw.parse()
    assert answer.model == DEFAULT_MODEL_NAME and answer.choices[0].message.content, answer
    return raw.headers["x-cpuserve-replica"]


def rank_pods(server) -> dict[str, str]:
    """Rank pod -> its revision label."""
    return {p["metadata"]["name"]: p["metadata"]["labels"]["cpuserve.dev/revision"]
            for p in server.kube.list("Pod", NS, f"cpuserve.dev/llmservice={NAME},app.kubernetes.io/component=rank")
            if not p["metadata"].get("deletionTimestamp")}


def test_a_weights_change_rolls_with_a_surge_and_serves_throughout(cluster):
    server, kubelet = cluster
    spec = server.kube.get("LLMService", NS, NAME)["spec"]
    api = ServeApi(f"http://127.0.0.1:{kubelet.head_ports[8265]}",
                   read_token(server.kube, NS, NAME, validate(server.kube.get("LLMService", NS, NAME),
                                                              OperatorSettings())[0]))
    # back to 1 replica, batching 8 streams at once, n-gram drafts and a shorter arrival window: a scale-down with a
    # new revision (the engine's args changed); the engine serves with what the spec asks
    before = set(rank_pods(server).values())
    server.kube.merge_patch("LLMService", NS, NAME, {"spec": {
        "replicas": 1, "batching": {"maxNumSeqs": NUM_STREAMS, "arrivalWindowMs": 5}, "speculative": {"method": "ngram"}}})
    (old_pod,) = wait_for("one group of the new revision", lambda: len(pods := rank_pods(server)) == 1 and
                          not set(pods.values()) & before and running(api, 1) and pods, timeout=420, interval=1)
    args = api.details()["applications"][ENGINE_APP_NAME]["deployed_app_config"]["args"]
    assert (args["speculative"], args["spec_tokens"], args["arrival_window_ms"]) == ("ngram", 4, 5), args
    grpc_port = spec["ports"]["grpc"]
    change_under_load(api, grpc_port, lambda: server.kube.merge_patch(
        "LLMService", NS, NAME, {"spec": {"quantization": {"weights": "int8"}}}), NUM_STREAMS, NUM_TOKENS,
        "weights change")
    wait_for("the old pod removed", lambda: len(pods := rank_pods(server)) == 1 and old_pod not in pods, timeout=120)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:  # requests after it: the new weights
        (model,) = pbg.InferenceStub(channel).ListModels(pb.ListModelsRequest(), timeout=30).models
    assert model.weights == "int8"
    wait_for("Ready", lambda: condition(server, "Ready").get("status") == "True" and
             server.kube.get("LLMService", NS, NAME)["status"]["observedGeneration"] ==
             server.kube.get("LLMService", NS, NAME)["metadata"]["generation"], timeout=120)
    assert not kubelet.exited, kubelet.exited
