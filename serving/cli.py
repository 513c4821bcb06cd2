"""`cpuserve serve`: start (or join) Ray, deploy the app, print the endpoints; on Ctrl-C / SIGTERM drain (new requests
refused, running ones finish within drain_timeout_s; a second signal cuts it short), then stop cleanly."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Callable

from cpuserve.engine.settings import SERVE_SUPERVISED


def register(subparsers: argparse._SubParsersAction) -> None:
    """`cpuserve serve`: one flag per ServeConfig field (name, type, default and description from the field)."""
    from cpuserve.engine.cli import add_flag
    from cpuserve.serving.config import ServeConfig

    p = subparsers.add_parser("serve", help="serve a model over gRPC and OpenAI-compatible HTTP (Ray Serve)",
                              description="Flags override --config; unset flags keep the YAML's or the defaults.")
    for name, field in ServeConfig.model_fields.items():
        # unset = None, so a YAML value or the ServeConfig default applies
        add_flag(p, name, field.annotation, field.default, field.description)
    p.add_argument("--num-threads", dest="cpus_per_rank", type=int, metavar="N",
                   help="another name of --cpus-per-rank: each rank runs this many torch threads and reserves as "
                        f"many Ray CPUs (default: {ServeConfig.model_fields['cpus_per_rank'].default})")
    p.add_argument("--config", help="YAML (or JSON) file of ServeConfig fields, snake_case or camelCase; flags "
                                    "override it (example: serving/serve.example.yaml) (default: none)")
    p.set_defaults(func=_serve)
    drain_timeout = ServeConfig.model_fields["drain_timeout_s"].default
    d = subparsers.add_parser("drain", help="drain a running app: new requests refused, running ones finish (a "
                                            "Kubernetes pod's preStop)",
                              description="Tells the app's Ingress to refuse new requests (503 / gRPC UNAVAILABLE, "
                                          "/health 503) and waits until no request runs or the timeout passes. "
                                          "Exits 0 either way; 1 when no app answers.")
    d.add_argument("--timeout-s", type=float, default=drain_timeout,
                   help=f"seconds to wait for the running requests at most (default: {drain_timeout:g})")
    d.add_argument("--ray-address", default="auto", help="the Ray cluster that runs the app (default: auto, the one "
                                                        "this node belongs to)")
    d.add_argument("--wait-only", action="store_true",
                   help="only wait for the running requests, refusing nothing (a rank pod's preStop: the head pod "
                        "drains; this pod's rank keeps serving until they end, and so does the engine behind this "
                        "pod's own HTTP port, if it has one) (default: off)")
    d.set_defaults(func=_drain_command)


def config_from_args(args: argparse.Namespace):
    from cpuserve.serving.config import ServeConfig, load_config

    return load_config(args.config, **{name: getattr(args, name) for name in ServeConfig.model_fields})


def _serve(args: argparse.Namespace) -> int:
    from cpuserve.engine.distributed.cpus import check_cpu_count
    from cpuserve.serving.app import endpoints, start_serving, stop_serving

    config = config_from_args(args)  # its ValueError is one line naming the file or field; main() prints it
    if config.ray_address is None:  # a local cluster: this machine's cores are every rank's
        check_cpu_count("cpus_per_rank", config.cpus_per_rank)
    config.check_model()
    if getattr(args, "from_command_line", False) and config.ray_address is None and not SERVE_SUPERVISED.get():
        return _supervise()
    if config.ray_address is None:  # the replicas run here: a checkout's kernels are built now, on this terminal
        from cpuserve.engine.layers import kernel_build

        kernel_build.prepare()
    signals: list[int] = []

    def on_signal(signum: int, _frame) -> None:
        # an append only: another signal may run this again before it returns (pkill signals both this process and
        # its supervisor, which passes its own on); a threading.Event's set() here deadlocked on the Event's lock
        signals.append(signum)

    def take_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

    take_signals()
    print(f"starting: {config.model_name}, {config.replicas} replica(s) x {config.ranks_per_replica} rank(s) x "
          f"{config.cpus_per_rank} CPU(s), "
          f"weights={config.weights}, kv-cache={config.kv_cache}", file=sys.stderr, flush=True)
    try:
        start_serving(config)
        take_signals()  # again: connecting to Ray put its own SIGTERM handler (a stack dump, then death) in place
        for name, url in endpoints(config).items():
            print(f"{name:8s}{url}", flush=True)
        print("serving; Ctrl-C stops", file=sys.stderr, flush=True)
        parent = os.getppid()
        while not signals and os.getppid() == parent:  # the supervisor gone: stop too
            time.sleep(0.2)
        if signals:
            _drain(config.drain_timeout_s, lambda: len(signals) > 1)
    finally:
        print("shutting down", file=sys.stderr, flush=True)
        stop_serving()
    return 0


def _drain_command(args: argparse.Namespace) -> int:
    import ray

    from cpuserve.engine import settings
    from cpuserve.serving.drain import drain_serving, wait_for_engine_idle
    from cpuserve.serving.ray_env import RAY_ENV

    for name, value in RAY_ENV.items():
        os.environ.setdefault(name, value)
    try:
        ray.init(address=args.ray_address, log_to_driver=False, logging_level="WARNING")
        deadline = time.monotonic() + args.timeout_s
        left = drain_serving(args.timeout_s, refuse=not args.wait_only)
        if args.wait_only and settings.ENGINE_HTTP_PORT.get() and (port := settings.ENGINE_METRICS_PORT.get()):
            # this pod's engine answers a gateway too: its requests end here, not at the Ingress
            left = max(left, wait_for_engine_idle(port, max(0.0, deadline - time.monotonic())))
    except Exception as e:  # noqa: BLE001 (no app, or it is failing: nothing to wait for)
        print(f"drain: no serving app answers on {args.ray_address} ({e!r})", file=sys.stderr, flush=True)
        return 1
    finally:
        ray.shutdown()
    print(f"drain: {left} request(s) still running after {args.timeout_s:g} s" if left else "drain: no request runs",
          file=sys.stderr, flush=True)
    return 0


def _drain(timeout_s: float, cut_short: Callable[[], bool]) -> None:
    from cpuserve.serving.drain import drain_serving

    print(f"draining: new requests get 503 / UNAVAILABLE; running ones have up to {timeout_s:g} s (Ctrl-C again: stop "
          "now)", file=sys.stderr, flush=True)
    try:
        left = drain_serving(timeout_s, cut_short)
    except Exception as e:  # noqa: BLE001 (the app is already failing: stop it anyway)
        print(f"drain failed ({e!r}): stopping", file=sys.stderr, flush=True)
        return
    if left:
        print(f"{left} request(s) still running: stopping them", file=sys.stderr, flush=True)


def _supervise() -> int:
    """Run this same command in its own session and pass it Ctrl-C / SIGTERM; returns its exit code.

    A local Ray cluster's processes (GCS, raylet, workers) are children of the serving process and would share the
    terminal's process group: `kill -TERM -PGID` (or a service manager stopping the group) would then kill them all
    at once, before the serving process could shut Serve down, leaving actors behind. In their own session only
    this supervisor receives the group's signal, and the serving process stops everything in order (as on Ctrl-C).
    """
    child = subprocess.Popen([sys.executable, *sys.orig_argv[1:]], env={**os.environ, SERVE_SUPERVISED.name: SERVE_SUPERVISED.text(True)},
                             start_new_session=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: child.send_signal(signal.SIGINT))
    while True:
        try:
            code = child.wait()
        except InterruptedError:  # a signal arrived while waiting: keep waiting for the orderly stop
            continue
        _kill_session(child.pid)
        return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention


def _kill_session(sid: int) -> None:
    """Kill what is left of the serving process's session: nothing after an orderly stop; after a SIGKILL of the
    serving process, Ray's GCS, raylet and workers end within 2 s on their own, but its dashboard and runtime-env
    agents linger about a minute (measured), holding ports."""
    import psutil

    for pid in psutil.pids():
        try:
            if pid != os.getpid() and os.getsid(pid) == sid:
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
