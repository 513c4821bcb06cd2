"""`cpuserve serve`: start (or join) Ray, deploy the app, print the endpoints, stop cleanly on Ctrl-C / SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading


_SUPERVISED = "CPUSERVE_SERVE_SUPERVISED"


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
    if getattr(args, "from_command_line", False) and config.ray_address is None and os.environ.get(_SUPERVISED) != "1":
        return _supervise()
    if config.ray_address is None:  # the replicas run here: a checkout's kernels are built now, on this terminal
        from cpuserve.engine.layers import kernel_build

        kernel_build.prepare()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting: {config.model_name}, {config.replicas} replica(s) x {config.ranks_per_replica} rank(s) x "
          f"{config.cpus_per_rank} CPU(s), "
          f"weights={config.weights}, kv-cache={config.kv_cache}", file=sys.stderr, flush=True)
    try:
        start_serving(config)
        for name, url in endpoints(config).items():
            print(f"{name:8s}{url}", flush=True)
        print("serving; Ctrl-C stops", file=sys.stderr, flush=True)
        parent = os.getppid()
        while not stop.wait(1.0) and os.getppid() == parent:  # the supervisor gone: stop too
            pass
    finally:
        print("shutting down", file=sys.stderr, flush=True)
        stop_serving()
    return 0


def _supervise() -> int:
    """Run this same command in its own session and pass it Ctrl-C / SIGTERM; returns its exit code.

    A local Ray cluster's processes (GCS, raylet, workers) are children of the serving process and would share the
    terminal's process group: `kill -TERM -PGID` (or a service manager stopping the group) would then kill them all
    at once, before the serving process could shut Serve down, leaving actors behind. In their own session only
    this supervisor receives the group's signal, and the serving process stops everything in order (as on Ctrl-C).
    """
    child = subprocess.Popen([sys.executable, *sys.orig_argv[1:]], env={**os.environ, _SUPERVISED: "1"},
                             start_new_session=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: child.send_signal(signal.SIGINT))
    while True:
        try:
            code = child.wait()
            return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention
        except InterruptedError:  # a signal arrived while waiting: keep waiting for the orderly stop
            continue
