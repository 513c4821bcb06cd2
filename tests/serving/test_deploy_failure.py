"""A replica that fails to start says why in start_serving's error, not only which deployment failed: here the
metrics port, taken after the pre-check passed (another process binding it while Ray starts)."""
from __future__ import annotations

import socket

import pytest

pytest.importorskip("ray.serve")

from cpuserve.serving import app  # noqa: E402
from cpuserve.serving.config import ServeConfig  # noqa: E402
from cpuserve.serving.ports import free_port  # noqa: E402


def test_a_port_taken_after_the_pre_check_is_named_in_the_error(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        real_bind = app.bind
        # the pre-check sees a free port: the Ingress replica then meets the taken one
        monkeypatch.setattr(app, "bind", lambda host, port, name="": real_bind(host, free_port(), name))
        config = ServeConfig(http_port=free_port(), grpc_port=free_port(), metrics_port=taken, kv_cache_gb=0.25)
        try:
            with pytest.raises(RuntimeError) as failed:
                app.start_serving(config)
        finally:
            app.stop_serving()
    message = str(failed.value)
    assert "Failed to update the deployments ['Ingress']" in message
    assert f"Ingress: RuntimeError: metrics_port={taken}: cannot bind 127.0.0.1:{taken}" in message, message
