"""One replica's own engine gauges, in vLLM's names, on a port of the replica's own pod: the metrics of the Gateway
API Inference Extension's model-server protocol, so an unmodified endpoint picker (and an HPA through a metrics
adapter) reads cpuserve as it reads vLLM.

Why each LLMServer replica serves them itself: the picker scrapes every model server (pod) it may pick and compares
them, so it needs one engine's queue and KV usage per pod. The ingress's `cpuserve_*` endpoint (serving/metrics.py)
sums the replicas into one service-wide view; it stays as it is. On Kubernetes a replica group's rank 0 runs in a
rank pod (a Ray worker node), so that pod is the model server, and the port belongs to the pod, not to the app:
the pod names it in CPUSERVE_ENGINE_METRICS_PORT (operator/pods.py), which the Ray worker that runs the replica
inherits from `ray start`. Unset (`cpuserve serve` on one machine, where replicas share one host): no endpoint.

    rank pod smollm2-g0-r0                        rank pod smollm2-g1-r0
      LLMServer replica -> :8081/metrics            LLMServer replica -> :8081/metrics
        vllm:num_requests_waiting{model_name}         (its own engine, read at each scrape)

The values are read from the engine at each scrape (a custom collector), so they are never older than the scrape.

Where the pod also serves the OpenAI API itself (engine_http.py: the gateway's requests), the same endpoint carries
that API's `cpuserve_*` request metrics (requests, tokens, TTFT, latencies): the head's `cpuserve_*` endpoint never
sees those requests, so a dashboard that sums `cpuserve_*` over the pods counts both ways in once each. The engine
gauges stay the head's (and `vllm:*` here).
"""
from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from cpuserve.engine import settings

ENGINE_METRICS_PORT_ENV = settings.ENGINE_METRICS_PORT.name
MODEL_LABEL = "model_name"  # vLLM's label on every metric


class EngineCollector(Collector):
    """vLLM-named metrics of one engine (anything with `stats()` returning engine/llm_engine.py's EngineStats)."""

    def __init__(self, engine: Any, model_name: str, block_size: int):
        self.engine = engine
        self.model_name = model_name
        self.block_size = block_size

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        model = [self.model_name]
        usage = (s.num_blocks - s.num_free_blocks) / s.num_blocks if s.num_blocks else 0.0
        for name, doc, value in (
                ("vllm:num_requests_running", "Requests in the running batch.", s.num_running),
                ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
                ("vllm:kv_cache_usage_perc", "Fraction of KV pool blocks in use (1 means 100 percent).", usage),
                # the name the protocol's first version and older pickers read: the same value
                ("vllm:gpu_cache_usage_perc", "Alias of vllm:kv_cache_usage_perc (a CPU's KV pool here).", usage)):
            gauge = GaugeMetricFamily(name, doc, labels=[MODEL_LABEL])
            gauge.add_metric(model, value)
            yield gauge
        info = GaugeMetricFamily("vllm:cache_config_info", "The KV block pool's configuration (value 1).",
                                 labels=[MODEL_LABEL, "block_size", "num_gpu_blocks"])
        info.add_metric([self.model_name, str(self.block_size), str(s.num_blocks)], 1.0)
        yield info
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Requests preempted because the KV pool ran out.",
                                          labels=[MODEL_LABEL])
        preemptions.add_metric(model, s.num_preemptions)
        yield preemptions


def engine_metrics_port(environ: dict[str, str] | None = None) -> int | None:
    """The port this process's pod names in CPUSERVE_ENGINE_METRICS_PORT, or None when unset or 0."""
    return settings.ENGINE_METRICS_PORT.get(environ) or None


class RequestMetrics(Collector):
    """The request-side families of an ingress's metrics (ServingMetrics.request_side) from its registry."""

    def __init__(self, metrics: Any, registry: CollectorRegistry):
        self.names = {family.name for metric in metrics.request_side() for family in metric.describe()}
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        return (family for family in self.registry.collect() if family.name in self.names)


def serve_engine_metrics(engine: Any, model_name: str, block_size: int, host: str, port: int,
                         ingress: Any = None):
    """Start the endpoint on host:port (a daemon thread); returns the server (call .shutdown() to stop it). With
    `ingress` (the IngressCore of the pod's own OpenAI API), its request metrics are served there too."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name, block_size))
    if ingress is not None:
        registry.register(RequestMetrics(ingress.metrics, ingress.registry))
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise RuntimeError(f"{ENGINE_METRICS_PORT_ENV}={port}: cannot bind {host}:{port} ({e.strerror}); each "
                           "replica needs a port of its own: set it per pod, and leave it unset on one machine "
                           "with several replicas") from e
    return server
