"""cpuserve.v1.Inference served by the Ingress replica itself, without Serve's gRPC proxy in between.

The same move as direct_http.py for gRPC: a grpc.aio server on `grpc_port` in the Ingress replica's event loop calls
the Ingress's own methods, so a GenerateResponse is written to the client by the process that built it. Serve's
gRPC proxy is then not started at all (no servicer functions are given to it), so nothing else listens for gRPC.

The Ingress's methods report a refused request as Serve's proxy expects: they set the status on the context and
raise RequestError. grpc.aio would answer such an exception as "Unexpected <class>: ..." with the code set, and log
it as a servicer failure; here it becomes `context.abort(code, message)`, the status and message a client of
Serve's proxy gets.
"""
from __future__ import annotations

from typing import Any

import grpc

from cpuserve.serving import grpc_api
from cpuserve.serving.protocol import RequestError

def _unary(method):
    async def call(request: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(request, context)
        except RequestError as e:
            await context.abort(grpc_api.status_code(e), e.message)
    return call


def _streaming(method):
    async def call(request: bytes, context: grpc.aio.ServicerContext):
        try:
            async for response in method(request, context):
                yield response
        except RequestError as e:
            await context.abort(grpc_api.status_code(e), e.message)
    return call


class _Servicer:
    """The Ingress's rpc methods, each refusal turned into an abort."""

    def __init__(self, ingress: Any):
        for method in grpc_api.SERVICE.methods:
            wrap = _streaming if method.server_streaming else _unary
            setattr(self, method.name, wrap(getattr(ingress, method.name)))


class DirectGRPC:
    """A grpc.aio server for `ingress` on host:port, bound at construction (a taken port fails there, by name)."""

    def __init__(self, ingress: Any, host: str, port: int, max_message_bytes: int):
        options = [("grpc.max_receive_message_length", max_message_bytes), ("grpc.so_reuseport", 0)]
        self.server = grpc.aio.server(options=options)
        grpc_api.add_InferenceServicer_to_server(_Servicer(ingress), self.server,
                                                 response_serializer=lambda m: m.SerializeToString())
        try:
            self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as e:
            raise RuntimeError(f"grpc_port={port}: cannot bind {host}:{port} ({e}); choose a free port") from e

    async def start(self) -> None:
        await self.server.start()

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.server.stop(grace_s)
