"""A real Serve app on 127.0.0.1 per test module: Ray, the gRPC and HTTP proxies, real SmolLM2 replicas.

A module sets `SERVE_CONFIG = {...}` (ServeConfig fields) to size its app, and may parametrize `serving` indirectly
(scope="module") with dicts of further fields to run its tests on several apps; ports are free ones picked here, as
other test runs may share the machine.
"""

from __future__ import annotations

import os
import ssl
import time

import httpx
import pytest

from cpuserve.serving.ports import free_port

pytest.importorskip("ray.serve")

BASE_CONFIG = dict(replicas=1, cpus_per_rank=2, kv_cache_gb=0.25, max_num_seqs=16, max_queued_requests=16,
                   stats_interval_s=0.25)


@pytest.fixture(scope="module")
def serving(request):
    """The running app's ServeConfig; the app and Ray stop when the module's tests are done."""
    fields = {**BASE_CONFIG, **getattr(request.module, "SERVE_CONFIG", {}), **getattr(request, "param", {})}
    yield from run_app(fields)


def run_app(fields: dict):
    """Start a Serve app of these ServeConfig fields on free ports, yield its config once /health answers, stop it
    (a generator for fixtures of any scope: tests/serving/fuzz runs one app for its whole package)."""
    from cpuserve.serving.app import start_serving, stop_serving
    from cpuserve.serving.config import ServeConfig

    for attempt in range(3):  # a port picked here may be taken before the proxies bind it (Ray's GCS picks one too)
        config = ServeConfig(**fields, grpc_port=free_port(), http_port=free_port(), metrics_port=free_port())
        try:
            start_serving(config)
            break
        except Exception as e:
            stop_serving()
            if "bind" not in str(e) or attempt == 2:
                raise
    scheme, verify = ("https", ssl.create_default_context(cafile=config.tls_cert_file)) if config.tls_cert_file \
        else ("http", True)
    try:
        deadline = time.monotonic() + 180
        while True:  # serve.run(blocking=False) returns before the proxies route: wait for /health
            try:
                health = httpx.get(f"{scheme}://127.0.0.1:{config.http_port}/health", timeout=5, verify=verify)
                if health.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the Serve app did not become healthy in 180 s"
            time.sleep(0.5)
        yield config
    finally:
        stop_serving()


@pytest.fixture(scope="module")
def engine_alone():
    """The engine without serving, as one single-rank replica runs it (int4 weights, int8 KV, one thread)."""
    from cpuserve.engine.llm import LLM

    return LLM(weights="int4", kv_cache="int8", kv_cache_gb=0.1, num_threads=1, show_progress=False)


@pytest.fixture(scope="module")
def http_url(serving) -> str:
    return f"{'https' if serving.tls_cert_file else 'http'}://127.0.0.1:{serving.http_port}"


@pytest.fixture(scope="module")
def grpc_stub(serving):
    import grpc

    from cpuserve.v1 import inference_pb2_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{serving.grpc_port}")
    yield inference_pb2_grpc.InferenceStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def scrape(serving):
    """A function returning the metrics endpoint as {'name{labels}': value}, labels as exposed (sorted)."""

    def _scrape() -> dict[str, float]:
        text = httpx.get(f"http://127.0.0.1:{serving.metrics_port}/metrics", timeout=5).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    return _scrape


os.environ.setdefault("RAY_AUTH_MODE", "disabled")
