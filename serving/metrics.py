"""The serving layer's Prometheus metric definitions (names, types, labels, buckets).

These are the only definitions: the serving code records into them, and the Grafana dashboards and the
alert rules in charts/cpuserve are checked by name against them (tests/charts). Every metric carries the
label `model`; the per-rank step time also carries `rank`.

Usage:
    registry = CollectorRegistry()
    metrics = build_serving_metrics(registry)
    metrics.requests.labels(model="smollm2", finish_reason="stop").inc()
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "cpuserve"
FINISH_REASONS = ("stop", "length", "abort", "error")  # the finish_reason label's values
REFUSAL_LIMITS = ("requests", "tokens")  # the limit label's values of requests refused at admission

# Latency buckets in seconds: CPU serving spans ~5 ms (one decode step of a tiny model) to minutes.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
INTER_TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


@dataclass(frozen=True, slots=True)
class ServingMetrics:
    """Handles to every serving metric; see build_serving_metrics."""

    requests: Counter
    refused: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    time_to_first_token: Histogram
    inter_token_latency: Histogram
    e2e_request_latency: Histogram
    request_queue_time: Histogram
    num_requests_running: Gauge
    num_requests_waiting: Gauge
    kv_cache_usage_ratio: Gauge
    preemptions: Counter
    engine_step: Histogram
    spec_draft_tokens: Counter
    spec_accepted_tokens: Counter


    def request_side(self) -> list[Counter | Histogram]:
        """What the ingress records per request (counts, tokens, latencies), not the engine gauges the replicas
        push to it."""
        return [self.requests, self.refused, self.prompt_tokens, self.generation_tokens, self.time_to_first_token,
                self.inter_token_latency, self.e2e_request_latency, self.request_queue_time]


def build_serving_metrics(registry: CollectorRegistry) -> ServingMetrics:
    """Create every serving metric on `registry` (one registry per process; calling twice raises)."""
    model = ("model",)
    return ServingMetrics(
        requests=Counter(
            f"{PREFIX}_requests", "Finished requests by finish reason (stop, length, abort, error).",
            ("model", "finish_reason"), registry=registry),
        refused=Counter(
            f"{PREFIX}_requests_refused", "Requests refused at admission (503 / RESOURCE_EXHAUSTED) by the limit "
            "they met: requests (max_queued_requests) or tokens (max_queued_tokens).", ("model", "limit"),
            registry=registry),
        prompt_tokens=Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens processed (prefill).", model, registry=registry),
        generation_tokens=Counter(
            f"{PREFIX}_generation_tokens", "Tokens generated (decode).", model, registry=registry),
        time_to_first_token=Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Arrival to first generated token.",
            model, buckets=TTFT_BUCKETS, registry=registry),
        inter_token_latency=Histogram(
            f"{PREFIX}_inter_token_latency_seconds", "Time between consecutive generated tokens.",
            model, buckets=INTER_TOKEN_BUCKETS, registry=registry),
        e2e_request_latency=Histogram(
            f"{PREFIX}_e2e_request_latency_seconds", "Arrival to the last token of a request.",
            model, buckets=E2E_BUCKETS, registry=registry),
        request_queue_time=Histogram(
            f"{PREFIX}_request_queue_time_seconds", "Arrival to first scheduling.",
            model, buckets=QUEUE_BUCKETS, registry=registry),
        num_requests_running=Gauge(
            f"{PREFIX}_num_requests_running", "Requests in the running batch.", model, registry=registry),
        num_requests_waiting=Gauge(
            f"{PREFIX}_num_requests_waiting", "Requests waiting to be scheduled.", model, registry=registry),
        kv_cache_usage_ratio=Gauge(
            f"{PREFIX}_kv_cache_usage_ratio", "Fraction of KV pool blocks in use (0..1).",
            model, registry=registry),
        preemptions=Counter(
            f"{PREFIX}_preemptions", "Requests preempted because the KV pool ran out.", model,
            registry=registry),
        engine_step=Histogram(
            f"{PREFIX}_engine_step_seconds", "Wall time of one engine step on one rank.",
            ("model", "rank"), buckets=STEP_BUCKETS, registry=registry),
        spec_draft_tokens=Counter(
            f"{PREFIX}_spec_draft_tokens", "Speculative draft tokens verified (proposed and run through the model).",
            model, registry=registry),
        spec_accepted_tokens=Counter(
            f"{PREFIX}_spec_accepted_tokens", "Speculative draft tokens accepted (kept in the output).", model,
            registry=registry),
    )


def initialize_serving_metrics(metrics: ServingMetrics, model: str) -> None:
    """Create every labelled series of `model` at zero, so dashboards and alerts read 0 instead of "No data"
    before the first request, preemption or step (a labelled metric has no sample until its labels are used)."""
    for reason in FINISH_REASONS:
        metrics.requests.labels(model=model, finish_reason=reason)
    for limit in REFUSAL_LIMITS:
        metrics.refused.labels(model=model, limit=limit)
    for metric in (metrics.prompt_tokens, metrics.generation_tokens, metrics.time_to_first_token,
                   metrics.inter_token_latency, metrics.e2e_request_latency, metrics.request_queue_time,
                   metrics.num_requests_running, metrics.num_requests_waiting, metrics.kv_cache_usage_ratio,
                   metrics.preemptions, metrics.spec_draft_tokens, metrics.spec_accepted_tokens):
        metric.labels(model=model)
    metrics.engine_step.labels(model=model, rank="0")  # rank 0 reports the step time (serving/telemetry.py)
