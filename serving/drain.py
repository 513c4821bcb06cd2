"""Draining a running app before it stops: the Ingress refuses new requests (503 / gRPC UNAVAILABLE, /health 503)
while the ones in flight run to their end, up to a grace period. `cpuserve serve` drains on SIGTERM / Ctrl-C."""
from __future__ import annotations

import asyncio
import threading
import time
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
