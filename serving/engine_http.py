"""One replica's own OpenAI HTTP API, on a port of the replica's own pod: where an InferencePool's gateway sends
the requests its endpoint picker assigns to that pod.

The Gateway API Inference Extension's picker chooses a model server (a pod) per request from the gauges each one
serves (serving/engine_metrics.py); the gateway then sends the request to that pod's target port with the OpenAI
HTTP API. So the pod that holds a replica group's engine (rank 0) answers HTTP itself: its LLMServer replica serves
the Ingress's own app (ingress.build_api) from an IngressCore whose LLMServer handle is this replica, in process
(local_handle.py). Validation, admission (503 + Retry-After past max_num_seqs running + max_queued_requests waiting,
for this engine alone), SSE streaming, API keys and TLS are the Ingress's code, not a second copy.

    rank pod smollm2-g0-r0
      LLMServer replica -> :8000 /v1/chat/completions /v1/completions /v1/models /health   (this engine only)
                        -> :8081 /metrics   vllm:* gauges of the same engine (engine_metrics.py), and the
                                            cpuserve_* request metrics of the requests on :8000
    head pod smollm2-head
      Ingress           -> :8000 the same API over every replica (Serve's router picks one)

Requests through the head still reach this engine as before, and both kinds count in its gauges. The port
belongs to the pod, which names it in CPUSERVE_ENGINE_HTTP_PORT (operator/pods.py); the Ray worker that runs the
replica inherits it from `ray start`. Unset (`cpuserve serve` on one machine): no such port.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cpuserve.engine import settings
from cpuserve.serving.config import ServeConfig
from cpuserve.serving.direct_http import DirectHTTP, bind
from cpuserve.serving.local_handle import LocalHandle

ENGINE_HTTP_PORT_ENV = settings.ENGINE_HTTP_PORT.name


def engine_http_port(environ: Mapping[str, str] | None = None) -> int | None:
    """The port this process's pod names in CPUSERVE_ENGINE_HTTP_PORT, or None when unset or 0."""
    return settings.ENGINE_HTTP_PORT.get(environ) or None


class EngineHTTP:
    """The Ingress's app for one LLMServer (`server`) on `port`, bound at construction: a port in use fails the
    replica's start, naming the variable. start() runs it on the caller's event loop, the one the engine streams on.
    """

    def __init__(self, server: Any, config: ServeConfig, port: int):
        from cpuserve.serving.ingress import IngressCore  # Ray Serve's too: only in a process that serves

        # one engine behind this door: one replica's admission limit; the pod's gauges are engine_metrics' port
        self.core = IngressCore({**config.model_dump(), "replicas": 1, "metrics_port": 0}, LocalHandle(server))
        self.http = DirectHTTP(bind(config.host, port, ENGINE_HTTP_PORT_ENV), config.tls_cert_file,
                               config.tls_key_file, config.access_log)
        self.is_started = False

    def start(self) -> None:
        """Serve from now on (once; later calls do nothing)."""
        from cpuserve.serving.ingress import build_api

        if not self.is_started:
            self.is_started = True
            self.http.start(build_api(self.core))

    def stop(self) -> None:
        self.http.stop()
