"""Environment every Ray process of a cpuserve cluster starts with (`cpuserve serve` sets what is unset; the
operator puts the same into its pods). Ray reads these when its processes start, so they cannot be per app.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    # Ray runs its workers at nice 15 by default: the replicas' engines would then yield their cores to every
    # other process of the node (the proxy, the ingress, a load generator). Measured: 14 ms steps instead of
    # 16 ms under one gRPC stream.
    "RAY_worker_niceness": "0",
    # Ray Serve's gRPC data plane, part of what RAY_SERVE_THROUGHPUT_OPTIMIZED turns on (Ray >= 2.55): handle
    # calls and their response streams go over gRPC between replicas instead of Ray tasks and object references,
    # and user code and the router run on the replica's own event loop instead of one thread each. Every token
    # message crosses two such hops (LLMServer -> Ingress -> proxy). Measured at 32 streams on 2 cores: 330 ->
    # 390-410 tokens/s. RAY_SERVE_THROUGHPUT_OPTIMIZED itself also turns on direct ingress, which opens a port
    # per ingress replica outside the configured ones and holds shutdown for a 30 s drain: not used (the
    # Ingress serves HTTP on the configured port itself instead, serving/direct_http.py).
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    # Serve's controller reconciles every 0.1 s by default, each time asking the GCS for every node's resources:
    # 3% of a core for the controller and 1.8% for the GCS on an idle 2-core node, taken from the engines. Every
    # 0.5 s halves both; deployments and recoveries react up to 0.4 s later.
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    # Ray's GCS and raylet run on its bundled jemalloc (see without_intel_openmp_preload). Under the soak the raylet's
    # live heap stayed at 4.7 MiB (measured with heaptrack) while its RssAnon crept up ~0.25 MiB a minute: jemalloc
    # purges an arena's freed pages only when that arena is used again, and most of the raylet's 31 threads rarely
    # allocate. Its background threads purge them on time (jemalloc's TUNING.md suggests them for long-running
    # servers). That left a slower creep, idle as under traffic: ~0.15 MiB a minute for 10 minutes and on (the 30-minute
    # soak: 12 -> 16 MiB), the per-thread caches (tcache) of its 34 threads filling one size class after another. Without
    # them it stays flat, and starts lower: an idle `cpuserve serve` on Zen 5, RssAnon sampled every 30 s for 7 minutes,
    # raylet 11.2 -> 12.4 MiB with them, 8.8 -> 8.4 without; the GCS 27.8 and 24.0 MiB at the end. Neither daemon is on
    # the token path (Serve's data plane is gRPC between the workers). Processes on glibc's malloc (the Python ones)
    # ignore this variable.
    "MALLOC_CONF": "background_thread:true,tcache:false",
    # Ray gives its GCS 30 s to start and publish its port ("Timed out waiting for file .../gcs_server_port_..."),
    # then fails ray.init. On 2 busy cores (the last cluster's processes still exiting, a build beside it) that was
    # seen to run out; waiting longer costs nothing when the GCS is quick.
    "RAY_gcs_server_port_wait_time_s": "120",
}


def own_data_plane(handle: Any) -> Any:
    """The handle, sending over the data plane this process's environment chooses (RAY_ENV: Serve's gRPC).

    A handle carries its options from where it was made: the process that built the app, which may have imported
    Ray Serve before RAY_ENV was set (a driver, a test) and then made every token's message to the ingress a Ray
    task result (an object reference each) instead of a gRPC stream message. Made as unpickling makes it
    (handle.options() would start its router here, before the replica runs)."""
    from ray.serve._private.constants import RAY_SERVE_USE_GRPC_BY_DEFAULT  # what Serve's own default reads

    options = handle.handle_options.copy_and_update(_by_reference=not RAY_SERVE_USE_GRPC_BY_DEFAULT)
    return type(handle)(handle.deployment_name, handle.app_name, handle_options=options)


@contextlib.contextmanager
def without_intel_openmp_preload() -> Iterator[None]:
    """Within: LD_PRELOAD without the Intel OpenMP library the `cpuserve` command re-executes itself with
    (engine/threads.py), so the Ray processes started meanwhile (GCS, raylet, dashboard, log monitor) run as in a pod,
    where `ray start` starts them: Ray preloads its own jemalloc into them only when LD_PRELOAD is unset. On glibc's
    malloc instead (with libiomp5 loaded for nothing) the GCS grew 23% and the raylet 20% in 8 minutes of the soak
    (bench/soak.py), and kept growing. The engines get Intel's OpenMP through their runtime_env (serving/app.py)."""
    from cpuserve.engine.threads import intel_openmp_library

    before, lib = os.environ.get("LD_PRELOAD"), intel_openmp_library()
    if before is None or lib is None or lib not in before.split(":"):
        yield
        return
    rest = ":".join(p for p in before.split(":") if p and p != lib)
    if rest:
        os.environ["LD_PRELOAD"] = rest
    else:
        del os.environ["LD_PRELOAD"]
    try:
        yield
    finally:
        os.environ["LD_PRELOAD"] = before


@contextlib.contextmanager
def head_without_extras() -> Iterator[None]:
    """Within: a head node that ray.init starts runs neither the autoscaler's monitor, nor the log monitor, nor the
    API server (the dashboard's backend, started even with include_dashboard=False). A local cluster of
    `cpuserve serve` uses none of them: one node that never scales, log_to_driver=False (nothing reads what the log
    monitor would forward), and no client of the REST API. Measured on 2 cores of an AMD EPYC Zen 5, an idle
    `cpuserve serve`: 3 processes and ~170 MiB PSS fewer (1274 -> 1105 MiB in all), Serve's controller up 0.8 s
    sooner (bench/cold_start.py, alternating runs). ray.init has no switch for them: its RayParams are made inside
    it, so they are amended as they are made (ray is pinned in pyproject.toml; tests/serving/test_serve_process.py
    checks the processes are absent). A cluster `ray start` runs (Kubernetes) is not touched."""
    from ray._private import node, parameter

    make_params, start_api_server = parameter.RayParams.__init__, node.Node.start_api_server

    def params_without_monitors(self, *args, **kwargs):
        make_params(self, *args, **kwargs)
        self.no_monitor, self.include_log_monitor = True, False

    parameter.RayParams.__init__ = params_without_monitors
    node.Node.start_api_server = lambda self, **kwargs: None
    try:
        yield
    finally:
        parameter.RayParams.__init__, node.Node.start_api_server = make_params, start_api_server
