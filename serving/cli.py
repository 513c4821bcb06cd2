"""`cpuserve serve`: start (or join) Ray, deploy the app, print the endpoints, stop cleanly on Ctrl-C / SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

# flag -> ServeConfig field, for the flags this module adds (the engine's come from add_engine_args)
_SERVE_FLAGS = ("replicas", "ranks_per_replica", "cpus_per_rank", "max_queued_requests", "host", "grpc_port",
                "http_port", "metrics_port", "ray_address", "api_key_file", "tls_cert_file", "tls_key_file",
                "socket_resource", "placement_strategy", "transport", "served_model_name", "stream_interval_ms",
                "stream_messages_per_s")
_ENGINE_FLAGS = ("model", "weights", "group_size", "kv_cache", "kv_cache_gb", "block_size", "max_num_seqs",
                 "max_num_batched_tokens", "max_model_len")


def register(subparsers: argparse._SubParsersAction) -> None:
    from cpuserve.engine.cli import add_engine_args

    p = subparsers.add_parser("serve", help="serve a model over gRPC and OpenAI-compatible HTTP (Ray Serve)",
                              description="Flags override --config; unset flags keep the YAML's or the defaults.")
    add_engine_args(p)
    p.add_argument("--replicas", type=int, help="LLMServer replicas, one engine each (default 1)")
    p.add_argument("--ranks-per-replica", type=int,
                   help="tensor-parallel ranks (sockets) per replica, at most the model's KV heads: rank 0 in the "
                        "replica, the others in Ray actors of its placement group (default 1)")
    p.add_argument("--cpus-per-rank", type=int, help="CPUs and torch threads per rank (default 2)")
    p.add_argument("--placement-strategy", choices=("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"),
                   help="Ray strategy of a replica's rank bundles: STRICT_PACK (default) = one node; PACK may use "
                        "several (one rank per --socket-resource pod)")
    p.add_argument("--transport", choices=("shm", "torch"),
                   help="collectives between ranks; default shm when a replica's ranks share a node, else torch")
    p.add_argument("--max-queued-requests", type=int,
                   help="waiting requests allowed beyond the running batches; more get 429 (default 64)")
    p.add_argument("--stream-interval-ms", type=float,
                   help="least time between two messages of one stream; sooner tokens go out together (default 0)")
    p.add_argument("--stream-messages-per-s", type=float,
                   help="messages per second a replica sends over all its streams at most: n open streams send "
                        "one every n / this seconds, sooner tokens going out together; 0 = no bound (default 128)")
    p.add_argument("--host", help="address of the HTTP and metrics endpoints (default 127.0.0.1)")
    p.add_argument("--grpc-port", type=int, help="default 9000")
    p.add_argument("--http-port", type=int, help="default 8000")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics, default 8080; 0 = off")
    p.add_argument("--ray-address", help="join this Ray cluster ('auto' on Kubernetes); default: start one")
    p.add_argument("--api-key-file", help="one accepted API key per line")
    p.add_argument("--tls-cert-file")
    p.add_argument("--tls-key-file")
    p.add_argument("--socket-resource", help="custom Ray resource each rank (bundle) needs one unit of")
    p.add_argument("--served-model-name", help="the name clients pass as model")
    p.add_argument("--config", help="YAML file of ServeConfig fields (see serving/config.py)")
    # None = not given, so a YAML value or the ServeConfig default applies
    p.set_defaults(func=_serve, **{name: None for name in _ENGINE_FLAGS})


def config_from_args(args: argparse.Namespace):
    from cpuserve.serving.config import load_config

    overrides = {name: getattr(args, name) for name in _SERVE_FLAGS + _ENGINE_FLAGS}
    if args.num_threads is not None:  # the engine's flag: here threads follow the CPUs reserved per rank
        overrides["cpus_per_rank"] = overrides["cpus_per_rank"] or args.num_threads
    return load_config(args.config, **overrides)


def _serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from cpuserve.serving.app import endpoints, start_serving, stop_serving

    try:
        config = config_from_args(args)
        config.check_model()  # its ValueError names the field; main() prints it
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "config"
        print(f"error: {field}: {err['msg']}", file=sys.stderr)
        return 2
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
        while not stop.wait(1.0):
            pass
    finally:
        print("shutting down", file=sys.stderr, flush=True)
        stop_serving()
    return 0
