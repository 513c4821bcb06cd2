"""AsyncLLMEngine: the engine steps in its own thread; each request is an async iterator of StepOutputs.

The engine thread is the only one that touches the scheduler. Callers hand it requests and aborts through
a command queue, and it hands chunks back to each request's asyncio queue on the caller's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator

from cpuserve.engine.config import EngineConfig
from cpuserve.engine.errors import EngineDeadError, InvalidRequest
from cpuserve.engine.llm_engine import EngineStats, LLMEngine
from cpuserve.engine.outputs import StepOutput
from cpuserve.engine.request import Request
from cpuserve.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
LONE_ARRIVALS = 1  # requests in a row that arrived alone, after which the next starts without waiting


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self.error: BaseException | None = None
        # wall time of each step (schedule + run + postprocess), drained by serving's metrics; bounded
        self._step_times: collections.deque[float] = collections.deque(maxlen=4096)
        self._beat = time.monotonic()  # the engine thread's last pass through its loop (idle: at least every second)
        self._lone_arrivals = 0  # requests in a row that arrived more than the arrival window after the one before
        self._last_arrival = -float("inf")
        self._thread = threading.Thread(target=self._loop, name="cpuserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, model: str | None = None, **config: Any) -> "AsyncLLMEngine":
        return cls(LLMEngine(EngineConfig.from_kwargs(model=model, **config)))

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[StepOutput]:
        """Yields one StepOutput per engine step that made progress (one new token, or the finish); the last has
        finished=True. Raises InvalidRequest on bad input before anything is queued. Leaving the iteration early
        (cancel, disconnect) aborts the request. (Pacing and merging chunks for a slow consumer is serving's
        policy: serving/pacing.py.)"""
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error!r}")
        if request_id in self._streams:
            raise InvalidRequest("request_id", f"request_id={request_id!r} is already running; give each request a "
                                               "unique id")
        request = self.engine.make_request(prompt, params, request_id, priority)
        chunks: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), chunks)
        self._send(("add", request))
        finished = False
        try:
            while not finished:
                chunk = await chunks.get()
                if isinstance(chunk, ValueError):
                    raise chunk
                if isinstance(chunk, BaseException):
                    raise EngineDeadError(f"engine stopped: {chunk!r}") from chunk
                finished = chunk.finished
                yield chunk
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    @property
    def max_model_len(self) -> int:
        """Tokens of context one request may use (prompt + output)."""
        return self.engine.max_model_len

    def check_health(self) -> None:
        """Raises EngineDeadError when no request can make progress: the engine thread died, or a rank of the
        replica group reports a problem (a single-rank engine has no ranks to ask)."""
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error!r}")
        reason = self.engine.health()  # the runner's: a replica group's failed step or dead rank
        if reason:
            raise EngineDeadError(f"replica group down: {reason}")

    def seconds_without_progress(self) -> float:
        """Since the engine thread last went round its loop: about 0 while it steps or waits idle (it wakes every
        second); a step that hangs (a rank stopped mid-collective) makes it grow."""
        return time.monotonic() - self._beat

    @property
    def num_streams(self) -> int:
        """Requests being streamed to a consumer right now."""
        return len(self._streams)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def pop_step_times(self) -> list[float]:
        """Seconds of each engine step since the last call (at most the last 4096), for step-time metrics."""
        times = []
        while self._step_times:
            times.append(self._step_times.popleft())
        return times

    def shutdown(self) -> None:
        """Stop the engine thread, then the replica group's workers (a single-rank engine has none)."""
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():  # the group's collectives belong to that thread: never race a step
            self.engine.close()

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _loop(self) -> None:
        try:
            while not self._stopped:
                self._beat = time.monotonic()
                if not self.engine.has_unfinished_requests():
                    if self._commands.empty():
                        # idle: fault in the KV pool 2 MiB at a time (a request waits for one region at most), then
                        # sleep until a command comes
                        if not self.engine.populate_kv():
                            self._wakeup.wait(timeout=1.0)
                            self._wakeup.clear()
                        continue
                    self._gather()  # the idle spell ends: the requests sent together join the first step
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    continue  # only aborts came
                start = time.perf_counter()
                chunks = self.engine.step()
                self._step_times.append(time.perf_counter() - start)
                self._deliver_step(chunks)
        except BaseException as e:  # the engine is broken: fail every waiting request rather than hang it
            log.exception("engine thread died")
            self.error = e
            for request_id in list(self._streams):
                self._deliver_error(request_id, e)

    def _gather(self) -> None:
        """After an idle spell, wait for the requests that were sent together to arrive, so that the first step
        prefills them all: up to arrival_window_ms, and no longer once none has come for a quarter of it. Served,
        a burst's requests reach the engine one by one; without this the first starts a step alone while the others
        are still on their way, and they wait a step more for their first token (docs/measurements/history.md,
        run K).

        Once the last LONE_ARRIVALS requests each arrived more than the window after the one before (a client at a
        time, where the wait only added a quarter window to each first token), the next starts at once; the window
        comes back with the first request that arrives within it of the one before (_note_arrival). A burst after
        such a request then starts with its first request alone, and the others join the next step: served, 4
        prompts of 128 tokens fill a step's budget, so the burst's last first token comes about as soon."""
        window = self.engine.config.arrival_window_ms / 1e3
        if window <= 0 or self._commands.empty() or self._lone_arrivals >= LONE_ARRIVALS:
            return
        deadline = time.monotonic() + window
        while (left := deadline - time.monotonic()) > 0 and self._wakeup.wait(timeout=min(left, window / 4)):
            self._wakeup.clear()

    def _note_arrival(self, request: Request) -> None:
        """Count the requests in a row that arrived alone: more than the arrival window after the one before."""
        alone = request.arrival_time - self._last_arrival > self.engine.config.arrival_window_ms / 1e3
        self._lone_arrivals = self._lone_arrivals + 1 if alone else 0
        self._last_arrival = max(self._last_arrival, request.arrival_time)

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._note_arrival(arg)
                try:
                    self.engine.add(arg)
                except ValueError as e:  # an id still held by an aborting request: fail only this one
                    self._deliver_error(arg.request_id, InvalidRequest("request_id", str(e)))
            else:
                chunk = self.engine.abort_request(arg)
                if chunk is not None:
                    self._deliver_step([chunk])

    def _deliver_step(self, chunks: list[StepOutput]) -> None:
        """Chunks to their streams, one wake-up per event loop (each call_soon_threadsafe writes its self-pipe)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for chunk in chunks:
            target = self._streams.get(chunk.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], chunk))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, chunks = target
            loop.call_soon_threadsafe(chunks.put_nowait, error)


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for chunks, chunk in items:
        chunks.put_nowait(chunk)
