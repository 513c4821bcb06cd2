"""The OpenAI HTTP endpoint served by the Ingress replica itself, without Serve's HTTP proxy in between.

Through Serve's proxy every SSE message crosses two processes after the LLMServer: the Ingress turns a chunk into
ASGI messages, Serve pickles them to the proxy, and the proxy writes them to the client. With `direct_http` the
Ingress replica runs its own uvicorn server on `http_port` for the same FastAPI app, so a message is written to
the client's socket by the process that built it. With direct_grpc as well, `cpuserve serve` starts no Serve proxy
at all; without it, Serve's proxy serves gRPC and answers HTTP on a free port of 127.0.0.1.

Measured on 2 cores at 32 streams (docs/measurements/history.md): the proxy and the Ingress together spent 355-361
us of CPU per output token with the proxy in the path and 114-120 us without it.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import uvicorn

log = logging.getLogger(__name__)


def bind(host: str, port: int, name: str = "http_port") -> socket.socket:
    """A listening socket on host:port; RuntimeError naming the field (name) when another process holds it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted replica rebinds past TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"{name}={port}: cannot bind {host}:{port} ({e.strerror}); choose a free port") from e
    return sock


class DirectHTTP:
    """A uvicorn server for `app` on a bound socket, running as a task on the replica's event loop."""

    def __init__(self, sock: socket.socket, ssl_certfile: str | None = None, ssl_keyfile: str | None = None,
                 access_log: bool = False):
        self.sock = sock
        self.options = dict(ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile, access_log=access_log)
        self.server: uvicorn.Server | None = None
        self.task: asyncio.Task | None = None

    def start(self, app: Any) -> None:
        """Serve `app` (an ASGI callable) from now on; call on the event loop that should run it."""
        # keep-alive as long as Serve's proxy keeps it (90 s): a pooled client connection outlives its pauses
        config = uvicorn.Config(app, lifespan="off", log_config=None, log_level="warning", timeout_keep_alive=90,
                                **self.options)
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # not the main thread: Ray's worker owns signals
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))
        self.task.add_done_callback(_log_failure)

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the Ingress's HTTP server stopped: %r", task.exception())
