"""serving/engine_metrics.py without Ray: the port a pod names, refused values, a taken port, the values read."""
from __future__ import annotations

import socket

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from cpuserve.engine.llm_engine import EngineStats
from cpuserve.serving.engine_metrics import (ENGINE_METRICS_PORT_ENV, EngineCollector, engine_metrics_port,
                                             serve_engine_metrics)


class StatsOnly:
    """What the collector reads of an engine: its stats (set by the test)."""

    def __init__(self, **fields):
        base = dict(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_preemptions=0, last_step_seconds=0.0,
                    num_free_blocks=100, num_blocks=100)
        self.value = EngineStats(**{**base, **fields})

    def stats(self) -> EngineStats:
        return self.value


@pytest.mark.parametrize("raw,port", [(None, None), ("", None), ("0", None), (" 8081 ", 8081)])
def test_port_from_the_pods_environment(raw, port):
    env = {} if raw is None else {ENGINE_METRICS_PORT_ENV: raw}
    assert engine_metrics_port(env) == port


@pytest.mark.parametrize("raw", ["80x", "-1", "70000"])
def test_a_bad_port_names_the_variable(raw):
    with pytest.raises(ValueError, match=f"{ENGINE_METRICS_PORT_ENV}='{raw}': must be a port number"):
        engine_metrics_port({ENGINE_METRICS_PORT_ENV: raw})


def test_a_taken_port_names_the_variable_and_the_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"{ENGINE_METRICS_PORT_ENV}={port}: cannot bind 127.0.0.1:{port}"):
            serve_engine_metrics(StatsOnly(), "m", 16, "127.0.0.1", port)


def test_values_are_the_engines_at_each_scrape():
    engine = StatsOnly(num_running=3, num_waiting=7, num_free_blocks=25, num_blocks=100, num_preemptions=2)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, "m", 16))
    text = generate_latest(registry).decode()
    for line in ('vllm:num_requests_running{model_name="m"} 3.0', 'vllm:num_requests_waiting{model_name="m"} 7.0',
                 'vllm:kv_cache_usage_perc{model_name="m"} 0.75', 'vllm:gpu_cache_usage_perc{model_name="m"} 0.75',
                 'vllm:cache_config_info{block_size="16",model_name="m",num_gpu_blocks="100"} 1.0',
                 'vllm:num_preemptions_total{model_name="m"} 2.0'):
        assert line in text
    engine.value = StatsOnly(num_waiting=0).value  # the next scrape reads the engine again
    assert 'vllm:num_requests_waiting{model_name="m"} 0.0' in generate_latest(registry).decode()
