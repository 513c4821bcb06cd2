"""The Ingress replica answers HTTP on http_port and gRPC on grpc_port itself (direct_http, direct_grpc: the
defaults of `cpuserve serve`), and Serve starts no proxy at all."""

from __future__ import annotations

import json

import httpx
import psutil
import pytest


def _listener(port: int) -> psutil.Process:
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
            return psutil.Process(conn.pid)
    raise AssertionError(f"nothing listens on port {port}")


def _stream(url: str) -> list[dict]:
    body = {"prompt": "The history of the bicycle", "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_the_ingress_replica_owns_the_http_port(serving, http_url):
    holder = _listener(serving.http_port)
    assert "Ingress" in " ".join(holder.cmdline())
    chunks = _stream(http_url)
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def test_the_ingress_replica_owns_the_grpc_port_and_serve_runs_no_grpc_proxy(serving):
    import grpc

    from cpuserve.v1 import inference_pb2 as pb
    from cpuserve.v1 import inference_pb2_grpc as pb_grpc

    holder = _listener(serving.grpc_port)
    assert "Ingress" in " ".join(holder.cmdline())
    with grpc.insecure_channel(f"127.0.0.1:{serving.grpc_port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        request = pb.GenerateRequest(text="The history of the bicycle",
                                     sampling=pb.SamplingParameters(max_tokens=8, temperature=0))
        reply = stub.Complete(request, timeout=120)
        assert reply.usage.completion_tokens == 8
        with pytest.raises(grpc.RpcError) as refused:  # a refusal keeps its status and message, as via the proxy
            stub.Complete(pb.GenerateRequest(model="another", text="x"), timeout=60)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert refused.value.details().startswith("model='another' is not served here")


def test_serve_starts_no_proxy(serving, http_url):
    from ray import serve

    assert serve.status().proxies == {}  # Serve's own account: no proxy on any node
    running = [p for p in psutil.process_iter(["cmdline"]) if "ray::ProxyActor" in " ".join(p.info["cmdline"] or [])]
    assert running == []
    assert _stream(http_url)[-1]["usage"]["completion_tokens"] == 8  # and the app serves all the same


def test_bad_input_answers_in_openai_shape_on_the_direct_port(http_url):
    r = httpx.post(f"{http_url}/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.get(f"{http_url}/v1/nowhere", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
