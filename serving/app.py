"""build_app(args) -> the Serve application; start_serving / stop_serving run it on a Ray cluster.

    Ingress (1 replica, 0 CPUs, on the head node: it owns the pod's ports and the Prometheus registry)
      --DeploymentHandle, streaming, routed by serving/router.py--> LLMServer (N replicas; each: cpus_per_rank
                                        CPUs, one engine, one unit of socket_resource when given)
                                         with ranks_per_replica = k > 1: a placement group of k such bundles
                                         per replica, the replica in bundle 0, rank actors in 1..k-1

A RayService can name `cpuserve.serving.app:build_app` as its import_path with ServeConfig fields as args;
the proxies' ports then come from the RayService's own http_options/grpc_options. The operator deploys the same
graph as two applications (build_ingress_app, build_engine_app: serving/names.py says why).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from pathlib import Path
from typing import Any

from cpuserve.engine.threads import openmp_env
from cpuserve.serving.affinity import ENGINE_CORES_ENV, on_cores, split_cores
from cpuserve.serving.config import ServeConfig
from cpuserve.serving.direct_http import bind
from cpuserve.serving.names import APP_NAME, GRPC_SERVICER, INGRESS_DEPLOYMENT, RANK_LABEL, SERVER_DEPLOYMENT
from cpuserve.serving.ports import free_port
from cpuserve.serving.ray_env import RAY_ENV, head_without_extras, without_intel_openmp_preload

log = logging.getLogger(__name__)

HEAD_NODE_RESOURCE = "node:__internal_head__"


def build_app(args: dict[str, Any] | ServeConfig):
    """The Ingress -> LLMServer graph for one model, sized by the config, as one application."""
    config = _config(args)
    return _ingress(config).bind(config.model_dump(), _server(config).bind(config.model_dump()))


def build_engine_app(args: dict[str, Any] | ServeConfig):
    """The LLMServer replicas alone, deployed as ENGINE_APP_NAME beside build_ingress_app's application."""
    config = _config(args)
    return _server(config).bind(config.model_dump())


def build_ingress_app(args: dict[str, Any] | ServeConfig):
    """The Ingress alone, deployed as APP_NAME: it finds the LLMServer replicas of ENGINE_APP_NAME by name, so a
    change of the engine's args (model, quantization) replaces those replicas while this one keeps serving."""
    config = _config(args)
    return _ingress(config).bind(config.model_dump(), None)


def _config(args: dict[str, Any] | ServeConfig) -> ServeConfig:
    config = args if isinstance(args, ServeConfig) else ServeConfig(**args)
    config.check_model()
    return config


def _server(config: ServeConfig):
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from cpuserve.serving.llm_server import LLMServer

    rank_resources = {config.socket_resource: 1} if config.socket_resource else {}
    selector = config.node_label_selector  # only Ray nodes of the rank pods' current revision (the operator's)
    group = {}
    if config.ranks_per_replica > 1:  # Serve creates the group per replica and removes it with the replica
        bundle = {"CPU": config.cpus_per_rank, **rank_resources}
        group = dict(placement_group_bundles=[bundle] * config.ranks_per_replica,
                     placement_group_strategy=config.placement_strategy,
                     **({"placement_group_bundle_label_selector": _bundle_selectors(config)} if selector else {}))
    # the engine steps off the replica's main thread: give it Intel's OpenMP (engine/threads.py)
    preload = openmp_env({})
    actor = {"num_cpus": config.cpus_per_rank, "resources": rank_resources,  # rank 0 (bundle 0)
             "runtime_env": {"env_vars": preload} if preload else {}}
    if selector and not group:
        actor["label_selector"] = selector
    if config.router == "serve":  # Serve's default class, PowerOfTwoChoicesRequestRouter
        router = RequestRouterConfig()
    else:
        router = RequestRouterConfig(request_router_class="cpuserve.serving.router:LLMRouter",
                                     request_router_kwargs={"prefix_affinity": config.router == "prefix"},
                                     request_routing_stats_period_s=1.0)
    return serve.deployment(LLMServer, name=SERVER_DEPLOYMENT).options(
        num_replicas=config.replicas, **group, ray_actor_options=actor, request_router_config=router,
        # admission happens at the ingress; this only caps what one replica accepts
        max_ongoing_requests=config.max_num_seqs + config.max_queued_requests + 1,
        health_check_period_s=2, graceful_shutdown_timeout_s=5)


def _bundle_selectors(config: ServeConfig) -> list[dict[str, str]]:
    """Per bundle of a replica group on the operator's rank pods: the revision's nodes, and the replica (bundle 0,
    the engine) on a rank-0 pod, the one that declares the HTTP port and probes it; the other ranks elsewhere."""
    selector = config.node_label_selector
    return [{**selector, RANK_LABEL: "0"}] + [{**selector, RANK_LABEL: "!0"}] * (config.ranks_per_replica - 1)


def _ingress(config: ServeConfig):
    from ray import serve

    from cpuserve.serving.scalable_ingress import ScalableIngress

    return serve.deployment(ScalableIngress, name=INGRESS_DEPLOYMENT).options(
        num_replicas=1, ray_actor_options={"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: 0.001}},
        max_ongoing_requests=10_000)  # its own admission limit is max_in_flight


def start_serving(config: ServeConfig, blocking_timeout_s: float = 600) -> None:
    """Connect to (or start) Ray, start Serve's proxies on the config's ports and deploy the app."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60's token auth; a local cluster needs none
    # before Ray Serve is imported here (it reads them once): a started cluster (Kubernetes) takes these from the
    # pod's environment
    for name, value in RAY_ENV.items():
        os.environ.setdefault(name, value)
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    if not config.access_log:
        os.environ.setdefault("RAY_SERVE_ENABLE_ACCESS_LOG", "0")
    # Ray's gRPC proxy accepts 2 GiB messages by default: bound memory per request. A started cluster (Kubernetes)
    # takes this from the pod's environment instead.
    os.environ.setdefault("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", str(2 * config.max_request_bytes))
    app = build_app(config)  # before Ray starts: a config the model cannot take fails here
    if not config.ray_address:  # the Ingress will bind these on this machine: fail here, before Ray starts
        for on, name in ((config.direct_http, "http_port"), (config.direct_grpc, "grpc_port"),
                         (config.metrics_port, "metrics_port")):
            if on:
                bind(config.host, getattr(config, name), name).close()
    if not ray.is_initialized():
        if config.ray_address:
            ray.init(address=config.ray_address, log_to_driver=False)
        else:
            split = _split_cores(config)
            # address="local": always a cluster of our own, never one another process left running on this machine
            # Ray's processes, started here: on the serving cores, on Ray's own allocator
            with on_cores(split[1] if split else None), without_intel_openmp_preload(), head_without_extras():
                ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",
                         log_to_driver=False,
                         num_cpus=max(config.replicas * config.cpus_per_replica, len(os.sched_getaffinity(0))),
                         resources={config.socket_resource: config.replicas * config.ranks_per_replica}
                         if config.socket_resource else None)
    if config.tls_cert_file:
        log.warning("TLS applies to HTTP only: gRPC listens in plaintext on port %d",
                    config.grpc_port)
    logging.getLogger("ray.serve").addFilter(_quiet_serve_start if config.direct_http else _quiet_connecting)
    if config.direct_http:  # the Ingress replica owns http_port; Serve's proxy, if any, answers on a private port
        http = HTTPOptions(host="127.0.0.1", port=free_port())
    else:
        http = HTTPOptions(host=config.host, port=config.http_port, ssl_certfile=config.tls_cert_file,
                           ssl_keyfile=config.tls_key_file)
    # with both ports the Ingress's own, Serve's proxy would carry no request: not started, one Ray actor fewer
    # waking up beside the engines (docs/measurements/history.md, "Serve's proxy, not started")
    proxies = "Disabled" if config.direct_http and config.direct_grpc else "HeadOnly"
    serve.start(proxy_location=proxies, http_options=http,
                # with direct_grpc no servicer: Serve then starts no gRPC proxy
                grpc_options=gRPCOptions(port=config.grpc_port,
                                         grpc_servicer_functions=[] if config.direct_grpc else [GRPC_SERVICER]))
    try:
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    except RuntimeError as e:
        raise RuntimeError(_with_replica_errors(str(e))) from e


def _with_replica_errors(message: str) -> str:
    """serve.run says only which deployments failed to deploy ("Failed to update the deployments ['Ingress']");
    each one's status message ends with its replica's own error (a port taken, named by field): add those."""
    from ray import serve

    app = serve.status().applications.get(APP_NAME)
    failed = [(name, d.message.strip().splitlines()) for name, d in (app.deployments.items() if app else ())
              if d.status.name == "DEPLOY_FAILED" and d.message.strip()]
    return "; ".join([message, *(f"{name}: {lines[-1]}" for name, lines in failed)])


def _split_cores(config: ServeConfig) -> tuple[list[int], list[int]] | None:
    """The engines' and the serving processes' cores of the cluster this process starts (serving/affinity.py),
    handed to the replicas in their environment; None when there is no core to spare (or replica groups, whose
    ranks are processes of their own)."""
    split = None
    if config.ranks_per_replica == 1:
        split = split_cores(sorted(os.sched_getaffinity(0)), config.replicas * config.cpus_per_replica)
    if split:
        os.environ[ENGINE_CORES_ENV] = ",".join(map(str, split[0]))
    else:
        os.environ.pop(ENGINE_CORES_ENV, None)
    return split


def _quiet_connecting(record: logging.LogRecord) -> bool:
    """serve.run after serve.start always logs that it connects to the Serve instance serve.start just made and
    will not apply new options: true and normal here, and read as a warning. Everything else passes."""
    return not record.getMessage().startswith("Connecting to existing Serve app")


def _quiet_serve_start(record: logging.LogRecord) -> bool:
    """As _quiet_connecting, and with direct_http also Serve's "Application ... is ready at <url>": that URL is
    its proxy's (private, or none), not where clients connect; `cpuserve serve` prints the endpoints itself."""
    return _quiet_connecting(record) and " is ready at http" not in record.getMessage()


def stop_serving() -> None:
    import ray
    from ray import serve

    if ray.is_initialized():
        import psutil

        started = psutil.Process().children(recursive=True)  # Ray's processes, when this one started the cluster
        _drop_normal_shutdown_lines()
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            _, late = psutil.wait_procs(started, timeout=10)  # workers stop shortly after their raylet
            for proc in late:  # the cluster is this process's: none of it outlives `cpuserve serve`
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            psutil.wait_procs(late, timeout=5)
            # and those Ray restarted or ended while serving: registered since this process started
            since = registrations_since(psutil.Process().create_time())
            remove_openmp_registrations({p.pid for p in started} | since)


# serve.shutdown() asks the controller to shut down gracefully and the controller then kills itself, so the
# raylet always reports that call, and this process's long poll of the controller, as failed ("... killed by
# `ray.kill`", with retries left): how it ends, not an error.
_NORMAL_SHUTDOWN = re.compile(r"ServeController\.(graceful_shutdown|listen_for_change) failed.*killed by `ray\.kill`")


def _drop_normal_shutdown_lines() -> None:
    """Filter that one line out of the cluster errors Ray prints in this process; every other line passes.

    Ray's error listener thread prints each error the cluster publishes with ray._private.worker's
    print_to_stdstream, looked up at each call: wrapping that name is the one place the line passes."""
    from ray._private import worker

    if not isinstance(worker.print_to_stdstream, functools.partial):  # wrap once
        worker.print_to_stdstream = functools.partial(_forward_unless_normal_shutdown, worker.print_to_stdstream)


def _forward_unless_normal_shutdown(print_lines, data: dict, **kwargs) -> None:
    lines = [line for line in data.get("lines", []) if not _NORMAL_SHUTDOWN.search(line)]
    if lines or not data.get("lines"):
        print_lines({**data, "lines": lines}, **kwargs)


def registrations_since(start: float, shm: Path = Path("/dev/shm")) -> set[int]:
    """The pids of this user's Intel OpenMP registration files written at or after `start` (a Unix time)."""
    suffix = f"_{os.getuid()}"
    pids = set()
    for path in shm.glob(f"__KMP_REGISTERED_LIB_*{suffix}"):
        pid = path.name[len("__KMP_REGISTERED_LIB_"):-len(suffix)]
        try:
            if pid.isdigit() and path.stat().st_mtime >= start:
                pids.add(int(pid))
        except FileNotFoundError:  # its process unregistered meanwhile
            pass
    return pids


def remove_openmp_registrations(pids: set[int], shm: Path = Path("/dev/shm")) -> list[Path]:
    """Remove the files Intel's OpenMP registers itself in (`__KMP_REGISTERED_LIB_<pid>_<uid>`) for those of `pids`
    that are gone. A process unregisters at exit, but Ray ends its workers without running library destructors,
    and each leaves one. Only files of this user and of processes no longer alive are touched; returns them."""
    import psutil

    removed = []
    for pid in pids:
        path = shm / f"__KMP_REGISTERED_LIB_{pid}_{os.getuid()}"
        if path.exists() and not psutil.pid_exists(pid):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def endpoints(config: ServeConfig) -> dict[str, str]:
    scheme = "https" if config.tls_cert_file else "http"
    host = config.host
    out = {"grpc": f"{host}:{config.grpc_port}", "http": f"{scheme}://{host}:{config.http_port}/v1"}
    if config.metrics_port:
        out["metrics"] = f"http://{host}:{config.metrics_port}/metrics"
    return out
