"""Draining a running app before it stops: the Ingress refuses new requests (503 / gRPC UNAVAILABLE, /health 503)
while the ones in flight run to their end, up to a grace period. `cpuserve serve` drains on SIGTERM / Ctrl-C.

A rank pod that serves its engine's own HTTP API (an InferencePool's gateway sends there, past the Ingress) also
waits, in its preStop, until that engine runs nothing, read from the engine's gauges on the pod
(serving/engine_metrics.py): those count the requests of both ways in. Kubernetes takes a terminating pod out of
the pool's endpoints, so new ones stop coming; the ones already running finish."""
from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from typing import Callable

from cpuserve.serving.names import APP_NAME


def drain_serving(timeout_s: float, should_stop: Callable[[], bool] = lambda: False, poll_s: float = 0.2,
                  refuse: bool = True) -> int:
    """Tell the Ingress to drain, then wait until it has no request in flight, timeout_s passes or should_stop()
    says to give up (a second Ctrl-C). refuse=False: only wait, new requests are still admitted. Returns the
    requests still in flight (0: drained)."""
    # Serve's router runs on its caller's event loop here (RAY_ENV), and its controller updates keep coming there
    # until the process ends: a loop of its own that outlives the call
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="cpuserve-drain", daemon=True).start()
    return asyncio.run_coroutine_threadsafe(_drain(timeout_s, should_stop, poll_s, refuse), loop).result()


async def _drain(timeout_s: float, should_stop: Callable[[], bool], poll_s: float, refuse: bool) -> int:
    from ray.serve.handle import DeploymentHandle

    # made here, not by serve.get_deployment_handle: Serve caches those and would shut its router down later, on
    # this loop after it closed
    drain = DeploymentHandle("Ingress", APP_NAME).options(method_name="drain")
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            num_in_flight = await asyncio.wait_for(drain.remote(refuse), max(5.0, timeout_s))
            if num_in_flight == 0 or time.monotonic() >= deadline or should_stop():
                return num_in_flight
            await asyncio.sleep(poll_s)
    finally:
        await drain.shutdown_async()


ENGINE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def engine_requests(metrics_port: int) -> int | None:
    """Requests the engine whose gauges this pod serves on metrics_port runs or holds waiting; None when nothing
    answers there (this pod's replica already gone, or placed elsewhere)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as rsp:
            text = rsp.read().decode()
    except OSError:
        return None
    return round(sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                     if s.name in ENGINE_GAUGES))


def wait_for_engine_idle(metrics_port: int, timeout_s: float, should_stop: Callable[[], bool] = lambda: False,
                         poll_s: float = 0.2, idle_polls: int = 3) -> int:
    """Wait until the engine runs nothing at idle_polls reads in a row (a request the gateway sent just before the
    pod left its endpoints arrives late), timeout_s passes or should_stop() says to give up. Returns the requests
    still there (0: idle, or no engine answers)."""
    deadline, idle = time.monotonic() + timeout_s, 0
    while True:
        left = engine_requests(metrics_port)
        if left is None:
            return 0
        idle = idle + 1 if left == 0 else 0
        if idle >= idle_polls or time.monotonic() >= deadline or should_stop():
            return left
        time.sleep(poll_s)
