"""Errors the engine raises at its public boundary (no torch here: serving's ingress imports this)."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine refuses; `param` names the offending parameter ("prompt", "max_tokens", ...).

    Serving answers it with HTTP 400 / gRPC INVALID_ARGUMENT and `param` as OpenAI's error.param, so no caller
    has to read the field out of the message.
    """

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message

    def __reduce__(self):  # pickles whole (the default would rebuild it from the message alone)
        return type(self), (self.param, self.message)


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error (or a step has stalled); no request can make progress.

    Defined here, not beside the engine: a failed health check carries it to Serve's controller, which must import
    its module to unpickle it; the engine's own module would load torch there (+124 MiB, measured).
    """
