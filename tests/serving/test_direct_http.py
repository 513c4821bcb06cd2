"""The Ingress replica answers HTTP on http_port itself (direct_http, the default of `cpuserve serve`), and Serve's
own HTTP proxy moves to a private port and still routes to the same app."""

from __future__ import annotations

import json

import httpx
import psutil


def _listener(port: int) -> psutil.Process:
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
            return psutil.Process(conn.pid)
    raise AssertionError(f"nothing listens on port {port}")


def _proxy_http_port(grpc_port: int) -> int:
    """The port Serve's proxy answers HTTP on: its listening socket on 127.0.0.1 other than the gRPC one."""
    return next(c.laddr.port for c in psutil.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.ip == "127.0.0.1" and c.laddr.port != grpc_port
                and "ProxyActor" in " ".join(psutil.Process(c.pid).cmdline()))


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


def test_serves_proxy_still_routes_to_the_same_app(serving, http_url):
    proxy = _proxy_http_port(serving.grpc_port)
    assert proxy != serving.http_port
    direct, through_proxy = _stream(http_url), _stream(f"http://127.0.0.1:{proxy}")
    text = lambda chunks: "".join(c["choices"][0]["text"] for c in chunks if c["choices"])  # noqa: E731
    assert text(direct) == text(through_proxy)  # greedy: the same completion either way


def test_bad_input_answers_in_openai_shape_on_the_direct_port(http_url):
    r = httpx.post(f"{http_url}/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.get(f"{http_url}/v1/nowhere", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
