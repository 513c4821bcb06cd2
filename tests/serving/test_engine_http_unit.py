"""An LLMServer replica's own OpenAI HTTP port (serving/engine_http.py) without Ray, in about a second: the replica
told its port the way a rank pod tells it (CPUSERVE_ENGINE_HTTP_PORT), a real uvicorn server and a real HTTP client,
test_serving_unit's FakeEngine behind it. The same with the real model through Serve: test_engine_metrics_protocol.py.
"""
from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

import httpx
import pytest

from cpuserve.serving.config import ServeConfig
from cpuserve.serving.engine_http import ENGINE_HTTP_PORT_ENV, engine_http_port
from cpuserve.serving.llm_server import LLMServer
from cpuserve.serving.ports import free_port

sys.path.insert(0, str(Path(__file__).parent))
from test_serving_unit import FakeEngine  # noqa: E402


@pytest.mark.parametrize("raw,port", [(None, None), ("", None), ("0", None), ("8000", 8000)])
def test_the_port_comes_from_the_pods_environment(raw, port):
    assert engine_http_port({} if raw is None else {ENGINE_HTTP_PORT_ENV: raw}) == port


def test_a_port_that_is_no_number_names_the_variable():
    with pytest.raises(ValueError, match=f"{ENGINE_HTTP_PORT_ENV}='http': must be a port number"):
        engine_http_port({ENGINE_HTTP_PORT_ENV: "http"})


def test_a_taken_port_fails_the_replica_naming_the_variable(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv(ENGINE_HTTP_PORT_ENV, str(port))
        with pytest.raises(RuntimeError, match=f"{ENGINE_HTTP_PORT_ENV}={port}: cannot bind 127.0.0.1:{port}"):
            LLMServer(ServeConfig(metrics_port=0), engine_cls=FakeEngine)


def test_the_replica_serves_the_ingress_api_with_one_engines_admission(monkeypatch):
    """replicas=3 in the config, but this door leads to one engine: 1 x max_num_seqs + max_queued_requests (1) in
    flight, the next gets the Ingress's 503 + Retry-After; bad input its 400 naming the field."""
    port = free_port()
    monkeypatch.setenv(ENGINE_HTTP_PORT_ENV, str(port))
    server = LLMServer(ServeConfig(replicas=3, max_num_seqs=1, max_queued_requests=0, metrics_port=0),
                       engine_cls=FakeEngine)
    server.engine.hold = True

    async def scenario():
        server._ensure_started()  # what Serve's first health check does on the replica's event loop
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            for _ in range(100):  # uvicorn starts within the loop's next turns
                try:
                    health = await client.get("/health")
                    break
                except httpx.ConnectError:
                    await asyncio.sleep(0.02)
            held = asyncio.create_task(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}))
            while server.engine.num_streams == 0:
                await asyncio.sleep(0.01)
            refused = await client.post("/v1/completions", json={"prompt": "hi"})
            bad = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
            server.engine.release.set()
            return health, await held, refused, bad, (await client.get("/v1/models")).json()

    health, held, refused, bad, models = asyncio.run(scenario())
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert held.status_code == 200 and held.json()["choices"][0]["text"] == "xxx"
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "overloaded_error"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert [m["id"] for m in models["data"]] == [server.config.model_name]
