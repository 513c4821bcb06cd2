"""The engine gauges the ingress exports: summed over the replicas that reported lately, computed at each scrape."""
from __future__ import annotations

from prometheus_client import CollectorRegistry

from cpuserve.serving.metrics import build_serving_metrics, initialize_serving_metrics
from cpuserve.serving.protocol import ModelInfo, ReplicaStats
from cpuserve.serving.telemetry import STALE_AFTER_S, EngineStatsAggregator

MODEL = "m"


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def report(replica: str, running: int, waiting: int, used: int, blocks: int = 100, preemptions: int = 0,
           model: str = MODEL) -> ReplicaStats:
    info = ModelInfo(name=model, max_model_len=2048, weights="int4", kv_cache="int8", replicas=2, tool_format="hermes")
    return ReplicaStats(replica_id=replica, model=info, num_running=running, num_waiting=waiting, num_used_blocks=used,
                        num_blocks=blocks, num_preemptions=preemptions, step_times=[0.01, 0.02])


def gauges(registry: CollectorRegistry) -> tuple[float, float, float]:
    return tuple(registry.get_sample_value(f"cpuserve_{name}", {"model": MODEL})
                 for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio"))


def test_gauges_sum_the_replicas_heard_from_lately_even_when_none_reports_again():
    registry, clock = CollectorRegistry(), Clock()
    metrics = build_serving_metrics(registry)
    initialize_serving_metrics(metrics, MODEL)
    stats = EngineStatsAggregator(metrics, MODEL, clock=clock)
    assert gauges(registry) == (0, 0, 0)
    stats.update(report("a", 1, 2, 30, preemptions=2))
    clock.now += 1
    stats.update(report("b", 1, 0, 10))
    assert gauges(registry) == (2, 2, 40 / 200)
    clock.now += STALE_AFTER_S - 0.5  # a is silent past the bound, b not yet: read at the scrape, no update needed
    assert gauges(registry) == (1, 0, 10 / 100)
    clock.now += 1  # both silent: nothing is running that anyone knows of
    assert gauges(registry) == (0, 0, 0)
    stats.update(report("a", 0, 1, 5, preemptions=3))
    assert gauges(registry) == (0, 1, 5 / 100) and stats.num_replicas == 1
    assert registry.get_sample_value("cpuserve_engine_step_seconds_count", {"model": MODEL, "rank": "0"}) == 6
    # a's total went 2 -> 3 across its silence: one more preemption, not three
    assert registry.get_sample_value("cpuserve_preemptions_total", {"model": MODEL}) == 3


def test_while_a_model_changes_each_models_replicas_are_summed_apart_and_the_newest_listed_first():
    registry, clock = CollectorRegistry(), Clock()
    stats = EngineStatsAggregator(build_serving_metrics(registry), None, clock=clock)  # learns models from reports
    assert stats.models() == {}
    stats.update(report("old", 2, 1, 30))
    clock.now += 1
    stats.update(report("new", 1, 0, 10, model="n"))
    assert list(stats.models()) == ["n", MODEL] and stats.models()["n"].name == "n"
    assert gauges(registry) == (2, 1, 30 / 100)
    assert (registry.get_sample_value("cpuserve_num_requests_running", {"model": "n"}),
            registry.get_sample_value("cpuserve_requests_total", {"model": "n", "finish_reason": "stop"})) == (1, 0)
    clock.now += STALE_AFTER_S - 0.5  # the old replica is gone: only the new model is served
    assert list(stats.models()) == ["n"] and gauges(registry) == (0, 0, 0)
