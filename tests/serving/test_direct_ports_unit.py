"""direct_http / direct_grpc without a running app: a taken port (and a taken metrics port) is refused by name, before
Ray starts. (A Serve config applied through Ray's REST API, the operator's, leaves the ports to Serve's proxies:
tests/operator/test_operator_serve_document.py.)"""

from __future__ import annotations

import socket

import pytest

from cpuserve.serving.config import ServeConfig
from cpuserve.serving.ports import free_port


@pytest.fixture
def taken_port():
    """A port another socket listens on meanwhile."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def test_a_taken_http_port_is_refused_by_name(taken_port):
    from cpuserve.serving.direct_http import bind

    with pytest.raises(RuntimeError, match=f"http_port={taken_port}: cannot bind 127.0.0.1:{taken_port}"):
        bind("127.0.0.1", taken_port)


def test_cpuserve_serve_refuses_a_taken_http_port_before_starting_ray(taken_port):
    import ray

    from cpuserve.serving.app import start_serving

    other, another, metrics = free_port(), free_port(), free_port()  # free now (taken_port + 1 was not always)
    with pytest.raises(RuntimeError, match=f"http_port={taken_port}: cannot bind"):
        start_serving(ServeConfig(http_port=taken_port, grpc_port=other, metrics_port=metrics))
    with pytest.raises(RuntimeError, match=f"grpc_port={taken_port}: cannot bind"):
        start_serving(ServeConfig(http_port=other, grpc_port=taken_port, metrics_port=metrics))
    with pytest.raises(RuntimeError, match=f"metrics_port={taken_port}: cannot bind"):
        start_serving(ServeConfig(http_port=other, grpc_port=another, metrics_port=taken_port))
    assert not ray.is_initialized()
