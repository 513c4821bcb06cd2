"""LocalHandle: what IngressCore uses of its DeploymentHandle to LLMServer, calling an LLMServer in this process.

The Ingress reaches the LLMServer replicas through Ray Serve (`handle.generate.remote(request)`); an LLMServer
replica that serves the HTTP API on its own port (serving/engine_http.py) runs the same IngressCore against its own
engine through this stand-in, so validation, admission, streaming and errors are the Ingress's, not a second copy.
Tests without Ray use it the same way.
"""
from __future__ import annotations

import asyncio
import inspect
from typing import Any, AsyncIterator


class _Responses:
    """A DeploymentResponseGenerator over a local async generator: iterate it, cancel it."""

    def __init__(self, items: AsyncIterator[Any]):
        self.items = items

    def __aiter__(self) -> "_Responses":
        return self

    async def __anext__(self) -> Any:
        return await self.items.__anext__()

    def cancel(self) -> None:
        """Close the generator (the LLMServer aborts the request in its engine); a no-op once it finished."""
        asyncio.get_running_loop().create_task(self.items.aclose())


class _Method:
    def __init__(self, fn: Any):
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """A streaming method's responses, or a task (awaitable and cancellable, as a DeploymentResponse)."""
        result = self.fn(*args, **kwargs)
        if inspect.isasyncgen(result):
            return _Responses(result)
        return asyncio.ensure_future(result)


class LocalHandle:
    """The methods IngressCore calls on LLMServer (generate, info, probe, tokenize), on `server` in this process."""

    def __init__(self, server: Any):
        self.server = server
        for name in ("generate", "info", "probe", "tokenize"):
            setattr(self, name, _Method(getattr(server, name)))

    def options(self, **options: Any) -> "LocalHandle":
        """Serve's per-call options (stream, serialization) mean nothing in one process."""
        return self
