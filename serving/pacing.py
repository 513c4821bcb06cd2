"""Stream pacing, serving's policy for how often one stream sends a message.

The engine yields one chunk per step. A server streaming over a slow hop (Ray, then the client) sends fewer,
larger messages: every chunk waiting when the consumer comes back goes out as one (`StepOutput.merge`), and with
a minimum interval, chunks arriving sooner wait and go out together. No chunk waits before the first one with text
has gone out, and the last never waits: a client's first token is the first text it sees, and a token may have
none of its own (the first bytes of a character that spans tokens). Paced from the first chunk on, such a token's
text would wait a whole interval, 62 ms at 8 streams and 250 ms at 32 by default (LLMServer's message budget).

    engine thread --chunks--> AsyncLLMEngine.generate --_pump task--> ready queue --paced()--> consumer
                                                                      (merged when the consumer comes back)
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable

from cpuserve.engine.outputs import StepOutput

_END = object()  # the engine's stream ended


async def paced(stream: AsyncIterator[StepOutput],
                min_interval: float | Callable[[], float] = 0.0) -> AsyncIterator[StepOutput]:
    """The chunks of one request's stream, merged while the consumer is behind and spaced out by min_interval.

    Args:
        stream: one request's chunks (AsyncLLMEngine.generate). Its errors are raised here, after the tokens that
            came before them; leaving this iteration early closes it (the engine aborts the request).
        min_interval: seconds between two chunks at least; tokens arriving sooner wait and go out together (no
            chunk waits until one with text has gone out, nor does the last). A function is asked again before each
            chunk (a server spacing messages by how many streams are open).
    """
    ready: asyncio.Queue = asyncio.Queue()
    pump = asyncio.get_running_loop().create_task(_pump(stream, ready))
    pending = None
    last_yield = 0.0
    shown = False  # a chunk with text went out: from then on chunks are spaced
    try:
        while True:
            chunk = pending if pending is not None else await ready.get()
            pending = None
            if chunk is _END:
                return
            if isinstance(chunk, BaseException):
                raise chunk
            interval = min_interval() if callable(min_interval) else min_interval
            if interval > 0 and shown and not chunk.finished:
                wait = last_yield + interval - time.monotonic()
                if wait > 0:  # pace the stream: what arrives meanwhile is merged below
                    await asyncio.sleep(wait)
            while not chunk.finished and not ready.empty():
                later = ready.get_nowait()
                if not isinstance(later, StepOutput):  # an error (or the end) comes on its own, after the tokens
                    pending = later
                    break
                chunk = chunk.merge(later)
            last_yield = time.monotonic()
            shown = shown or bool(chunk.new_text)
            yield chunk
            if chunk.finished:
                return
    finally:
        pump.cancel()  # a no-op once the stream ended; otherwise closes it, which aborts the request


async def _pump(stream: AsyncIterator[StepOutput], ready: asyncio.Queue) -> None:
    """Moves chunks from the engine's stream to `ready` as they arrive, whatever the consumer is doing."""
    try:
        async for chunk in stream:
            ready.put_nowait(chunk)
    except Exception as e:  # noqa: BLE001 (bad input, engine stopped: the consumer raises it)
        ready.put_nowait(e)
    else:
        ready.put_nowait(_END)
