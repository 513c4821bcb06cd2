"""A serving replica's own endpoints, what an InferencePool's endpoint picker and gateway use: its gauges
(serving/engine_metrics.py) against the Gateway API Inference Extension's model-server protocol, and its OpenAI HTTP
API (serving/engine_http.py) through the official `openai` client. A real Serve app on 127.0.0.1 with the real
SmolLM2, its LLMServer replica told its ports the way a rank pod tells them (CPUSERVE_ENGINE_METRICS_PORT and
CPUSERVE_ENGINE_HTTP_PORT in the environment Ray's workers inherit), scraped while streams queue up behind a batch of
2, half of them sent to the replica's own port as a gateway sends them.

PROTOCOL is the protocol's "Metrics Reporting" table, written here from its document:
kubernetes-sigs/gateway-api-inference-extension, docs/proposals/003-model-server-protocol/README.md
(https://github.com/kubernetes-sigs/gateway-api-inference-extension/tree/main/docs/proposals/003-model-server-protocol).
Its vLLM column gives the names an unmodified endpoint picker reads; "Labeled" rows are read from a label of
`vllm:cache_config_info`. The protocol's first version named KV usage `vllm:gpu_cache_usage_perc` (older pickers
read that), and vLLM labels every metric with `model_name`; vLLM's preemption counter completes the set.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from cpuserve.serving.drain import engine_requests, wait_for_engine_idle
from cpuserve.serving.engine_http import ENGINE_HTTP_PORT_ENV
from cpuserve.serving.engine_metrics import ENGINE_METRICS_PORT_ENV
from cpuserve.serving.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# (protocol metric, type, vLLM name, the labels it carries): the document's table
PROTOCOL = [
    ("TotalQueuedRequests", "gauge", "vllm:num_requests_waiting", {"model_name"}),
    ("TotalRunningRequests", "gauge", "vllm:num_requests_running", {"model_name"}),
    ("KVCacheUtilization", "gauge", "vllm:kv_cache_usage_perc", {"model_name"}),
    ("KVCacheUtilization (v1 of the doc)", "gauge", "vllm:gpu_cache_usage_perc", {"model_name"}),
    ("BlockSize, NumGPUBlocks (labeled)", "gauge", "vllm:cache_config_info",
     {"model_name", "block_size", "num_gpu_blocks"}),
    ("preemptions (vLLM's counter)", "counter", "vllm:num_preemptions", {"model_name"}),
]
MAX_NUM_SEQS, NUM_STREAMS, NUM_TOKENS = 2, 9, 48
SERVE_CONFIG = dict(max_num_seqs=MAX_NUM_SEQS, max_queued_requests=16, block_size=16)
VALUES = Path(__file__).resolve().parents[2] / "charts" / "cpuserve" / "values.yaml"


@pytest.fixture(scope="module", autouse=True)
def engine_port():
    """The port a rank pod names, set before the module's app starts Ray (its workers inherit it)."""
    yield from pod_port(ENGINE_METRICS_PORT_ENV)


@pytest.fixture(scope="module", autouse=True)
def engine_http_url():
    """The replica's own OpenAI API, the gateway's way in (its port set as engine_port's)."""
    for port in pod_port(ENGINE_HTTP_PORT_ENV):
        yield f"http://127.0.0.1:{port}"


def pod_port(name: str):
    port = free_port()
    os.environ[name] = str(port)
    yield port
    os.environ.pop(name, None)


def scrape(port: int) -> tuple[str, dict]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, name: str) -> float:
    (sample,) = families[name].samples
    return sample.value


def test_every_protocol_metric_has_its_name_type_and_labels(serving, engine_port):
    text, families = wait_for_endpoint(engine_port)
    for metric, kind, name, labels in PROTOCOL:
        assert name in families and families[name].type == kind, f"{metric}: {name} is not exposed as a {kind}"
        (sample,) = [s for s in families[name].samples if not s.name.endswith("_created")]
        assert set(sample.labels) == labels, (metric, sample.labels)
        assert sample.labels["model_name"] == serving.model_name
    assert "vllm:num_preemptions_total{" in text  # the counter's sample name, as vLLM exposes it
    (info,) = families["vllm:cache_config_info"].samples
    assert info.value == 1 and info.labels["block_size"] == str(serving.block_size)
    assert int(info.labels["num_gpu_blocks"]) > 0


def wait_for_endpoint(port: int, timeout: float = 120) -> tuple[str, dict]:
    deadline = time.monotonic() + timeout
    while True:  # the replica starts its endpoint while Serve reports the app healthy: at most moments apart
        try:
            return scrape(port)
        except httpx.HTTPError:
            assert time.monotonic() < deadline, f"nothing serves the engine's metrics on port {port}"
            time.sleep(0.5)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)


def wait_for_health(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:  # the replica starts its server at Serve's first health check, moments after the app is up
        try:
            if httpx.get(f"{url}/health", timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"the replica's own API at {url} did not become healthy"
        time.sleep(0.5)


def test_the_replicas_own_port_serves_the_openai_api(serving, engine_http_url, http_url):
    """The official client on the replica's own port: the same answers as through the head (greedy, one engine),
    streamed and not, and the Ingress's 400 naming the field."""
    wait_for_health(engine_http_url)
    pod, head = client(engine_http_url), client(http_url)
    assert [m.id for m in pod.models.list().data] == [serving.model_name]
    ask = dict(model=serving.model_name, messages=[{"role": "user", "content": "What is the capital of France?"}],
               max_tokens=12, temperature=0)
    answer = pod.chat.completions.create(**ask)
    assert answer.choices[0].message.content == head.chat.completions.create(**ask).choices[0].message.content
    assert 0 < answer.usage.completion_tokens <= 12 and answer.choices[0].message.content
    chunks = list(pod.chat.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == answer.choices[0].finish_reason
    with pytest.raises(openai.BadRequestError) as refused:
        pod.completions.create(model=serving.model_name, prompt="hi", max_tokens=0)
    assert refused.value.status_code == 400 and refused.value.param == "max_tokens"


def request_counts(port: int) -> tuple[float, float, dict]:
    """(finished requests, TTFT observations, every family) of the pod's `cpuserve_*` request metrics."""
    _, families = scrape(port)
    done = sum(s.value for s in families["cpuserve_requests"].samples if s.name == "cpuserve_requests_total")
    (ttft,) = [s.value for s in families["cpuserve_time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    return done, ttft, families


def test_the_gateways_requests_count_on_the_pods_metrics_port(serving, engine_port, engine_http_url, http_url):
    """A request through the replica's own port (the gateway's way in) counts in the `cpuserve_*` request metrics
    of the pod's metrics port, which the head's endpoint never sees; one through the head does not count there (the
    head's endpoint has it). The engine gauges there are the `vllm:*` ones only."""
    wait_for_health(engine_http_url)
    done, ttft, _ = request_counts(engine_port)
    ask = dict(model=serving.model_name, prompt="The capital of France is", max_tokens=4, temperature=0)
    client(http_url).completions.create(**ask)
    client(engine_http_url).completions.create(**ask)
    deadline = time.monotonic() + 30
    while request_counts(engine_port)[0] < done + 1 and time.monotonic() < deadline:
        time.sleep(0.2)  # the ingress records a request as its stream ends, moments after the client has it
    after_done, after_ttft, families = request_counts(engine_port)
    assert (after_done - done, after_ttft - ttft) == (1, 1)
    assert "cpuserve_num_requests_running" not in families and "vllm:num_requests_running" in families


def test_gauges_follow_the_engine_and_cross_the_autoscaling_threshold(serving, engine_port, http_url,
                                                                      engine_http_url):
    """9 streams on a batch of 2, every other one through the replica's own port (as a gateway sends them): the
    running gauge reads the batch, the queue climbs past the chart's default HPA threshold (values.yaml
    autoscaling.queueDepthTarget), KV usage rises, then everything returns to 0."""
    threshold = yaml.safe_load(VALUES.read_text())["autoscaling"]["queueDepthTarget"]
    assert NUM_STREAMS - MAX_NUM_SEQS > threshold, "the load must be able to cross the threshold"
    wait_for_endpoint(engine_port)
    wait_for_health(engine_http_url)
    clients = [client(http_url), client(engine_http_url)]
    finished: list[str] = []

    def stream(i: int) -> None:
        chunks = clients[i % 2].completions.create(model=serving.model_name, prompt=f"Story {i}: once upon a time",
                                           max_tokens=NUM_TOKENS, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        finished.extend(c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(NUM_STREAMS)]
    for t in threads:
        t.start()
    seen = {"running": 0.0, "waiting": 0.0, "usage": 0.0}
    while any(t.is_alive() for t in threads):
        _, f = scrape(engine_port)
        seen = {"running": max(seen["running"], value(f, "vllm:num_requests_running")),
                "waiting": max(seen["waiting"], value(f, "vllm:num_requests_waiting")),
                "usage": max(seen["usage"], value(f, "vllm:kv_cache_usage_perc"))}
        assert value(f, "vllm:gpu_cache_usage_perc") == value(f, "vllm:kv_cache_usage_perc")
        assert value(f, "vllm:num_requests_running") <= MAX_NUM_SEQS
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert finished == ["length"] * NUM_STREAMS
    assert seen["running"] == MAX_NUM_SEQS
    assert seen["waiting"] > threshold, seen
    assert 0 < seen["usage"] <= 1
    _, f = scrape(engine_port)
    assert value(f, "vllm:num_requests_running") == value(f, "vllm:num_requests_waiting") == 0


def test_a_rank_pods_drain_waits_for_the_streams_on_its_own_port(serving, engine_port, engine_http_url):
    """The preStop's wait (serving/drain.py) on streams sent to the replica's own port, past the Ingress: cut short it
    reports them; given the time it returns only after the engine's gauges last showed one, and every stream ran to
    its end."""
    wait_for_health(engine_http_url)
    pod = client(engine_http_url)
    finished: list[str] = []

    def stream(i: int) -> None:
        chunks = pod.completions.create(model=serving.model_name, prompt=f"Story {i}: once upon a time",
                                        max_tokens=128, temperature=0, stream=True, extra_body={"ignore_eos": True})
        finished.extend(c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    busy: list[float] = []  # when a read of the gauges that found a request began (they only fall from here on)

    def watch() -> None:
        while any(t.is_alive() for t in threads):
            began = time.monotonic()
            if engine_requests(engine_port):
                busy.append(began)
            time.sleep(0.02)

    deadline = time.monotonic() + 60
    while (engine_requests(engine_port) or 0) < MAX_NUM_SEQS:  # the batch is running
        assert time.monotonic() < deadline, "the streams never reached the engine"
        time.sleep(0.02)
    watcher = threading.Thread(target=watch)
    watcher.start()
    assert wait_for_engine_idle(engine_port, timeout_s=0.1) > 0  # cut short: they are still there
    assert wait_for_engine_idle(engine_port, timeout_s=120) == 0
    returned = time.monotonic()
    for t in [*threads, watcher]:
        t.join()
    assert finished == ["length"] * 3 and busy and max(busy) < returned
    assert wait_for_engine_idle(free_port(), timeout_s=5) == 0  # no engine answers there: nothing to wait for
