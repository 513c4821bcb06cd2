"""The soak's clients (bench/soak.py): each request's outcome as the client saw it, over gRPC or HTTP SSE.

Outcomes: completed (a finish reason came), refused (503 at admission / RESOURCE_EXHAUSTED), cancelled (the client
closed the stream at a point it picked), deadline (its gRPC deadline passed), failed (anything else: another status,
an error event inside a stream, a dropped connection) and hung (no end within the hang bound).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import grpc

from cpuserve.v1 import inference_pb2 as pb

# greedy requests whose tokens are compared with the engine alone afterwards (ignore_eos: a fixed length)
GREEDY_PROMPTS = ["The capital of France is", "Write a haiku about the sea:", "List three prime numbers:",
                  "Explain what a CPU cache is in one sentence."]
GREEDY_TOKENS = 24
WORDS = "alpha beta gamma delta kernel cache socket thread token stream block replica prompt batch".split()


@dataclass
class Result:
    proto: str  # grpc | http
    kind: str  # stream | burst | greedy
    outcome: str = "failed"
    detail: str = ""
    ttft: float | None = None  # seconds to the first token
    itl: float | None = None  # mean seconds between tokens of this request
    tokens: int = 0
    ids: list[int] = field(default_factory=list)  # greedy gRPC requests: the tokens
    text: str = ""  # greedy HTTP requests: the text
    greedy: int | None = None  # index into GREEDY_PROMPTS
    retry_after: float = 1.0


@dataclass
class Plan:
    """One request: what to send and how the client behaves."""
    prompt: str
    max_tokens: int
    greedy: int | None = None
    cancel_after: int | None = None  # tokens after which the client leaves
    deadline: float | None = None  # gRPC deadline, seconds


def make_plan(rng: random.Random, proto: str) -> Plan:
    """Mixed lengths: prompts of ~10, ~200 or ~800 tokens, outputs of 8 to 256; a quarter greedy samples of the
    fixed prompts; 20% cancel at a random token; 10% of gRPC requests with a deadline of 0.3 to 3 s."""
    if rng.random() < 0.25:
        g = rng.randrange(len(GREEDY_PROMPTS))
        return Plan(GREEDY_PROMPTS[g], GREEDY_TOKENS, greedy=g)
    words = rng.choice([8, 150, 600])
    prompt = f"{rng.randrange(10**9)}: " + " ".join(rng.choice(WORDS) for _ in range(words))
    plan = Plan(prompt, rng.choice([8, 16, 32, 64, 128, 256]))
    if rng.random() < 0.2:
        plan.cancel_after = rng.randrange(1, plan.max_tokens)
    elif proto == "grpc" and rng.random() < 0.1:
        plan.deadline = rng.uniform(0.3, 3.0)
    return plan


def _timing(r: Result, start: float, first: float | None, last: float | None) -> None:
    if first is not None:
        r.ttft = first - start
        if r.tokens > 1 and last is not None:
            r.itl = (last - first) / (r.tokens - 1)


class Hung(Exception):
    """Nothing came within the hang bound."""


class Stopped(Exception):
    """The soak ended while waiting: the client leaves."""


class RunClock:
    """Seconds this process has run: a gap of more than 2 s between its ticks (the process was stopped, as this
    machine's other work pauses everything for a while) counts as 2 s, so a pause is never taken for a hang."""

    def __init__(self) -> None:
        self.now, self._last = 0.0, time.monotonic()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            t = time.monotonic()
            self.now, self._last = self.now + min(t - self._last, 2.0), t


@dataclass
class Bounds:
    hang_s: float  # nothing for this long (of RunClock time): hung
    stop: asyncio.Event  # set at the soak's end
    clock: RunClock


async def within(awaitable, b: Bounds):
    """The awaitable's result; Hung after b.hang_s of run time with nothing, Stopped once the soak ends."""
    task, since = asyncio.ensure_future(awaitable), b.clock.now
    while not task.done():
        await asyncio.wait({task}, timeout=1.0)
        if not task.done() and (b.stop.is_set() or b.clock.now - since > b.hang_s):
            task.cancel()
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its end is nobody's business now
            raise Stopped() if b.stop.is_set() else Hung(f"nothing for {b.hang_s:g} s")
    return task.result()


async def messages(iterator, b: Bounds):
    """The iterator's items, each within the hang bound of the last; ends once the soak ends."""
    it = aiter(iterator)
    while True:
        try:
            yield await within(anext(it), b)
        except (StopAsyncIteration, Stopped):
            return


async def grpc_stream(stub, plan: Plan, b: Bounds) -> Result:
    r = Result("grpc", "stream", greedy=plan.greedy)
    sampling = pb.SamplingParameters(max_tokens=plan.max_tokens, temperature=0 if plan.greedy is not None else 0.8,
                                     ignore_eos=True)
    start, first, last = time.monotonic(), None, None
    call = stub.Generate(pb.GenerateRequest(text=plan.prompt, sampling=sampling), timeout=plan.deadline)
    try:
        async for msg in messages(call, b):
            if msg.token_ids:
                first, last = first or time.monotonic(), time.monotonic()
                r.tokens += len(msg.token_ids)
                r.ids += list(msg.token_ids)
            if msg.finish_reason:
                r.outcome = "completed"
            if plan.cancel_after is not None and r.tokens >= plan.cancel_after and r.outcome != "completed":
                call.cancel()
                r.outcome = "cancelled"
                break
        if r.outcome not in ("completed", "cancelled") and b.stop.is_set():
            call.cancel()
            r.outcome, r.detail = "cancelled", "at the end"
        elif r.outcome not in ("completed", "cancelled"):
            r.detail = "the stream ended without a finish reason"
    except Hung as e:
        call.cancel()
        r.outcome, r.detail = "hung", str(e)
    except grpc.aio.AioRpcError as e:
        code = e.code()
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            r.outcome = "refused"
            r.retry_after = float(dict(e.trailing_metadata() or ()).get("retry-after", 1))
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED and plan.deadline is not None:
            r.outcome = "deadline"
        else:
            r.detail = f"gRPC {code.name}: {e.details()}"[:300]
    _timing(r, start, first, last)
    return r


async def grpc_complete(stub, plan: Plan) -> Result:
    r = Result("grpc", "burst")
    try:
        rsp = await stub.Complete(pb.GenerateRequest(text=plan.prompt, sampling=pb.SamplingParameters(
            max_tokens=plan.max_tokens, ignore_eos=True)))
        r.outcome, r.tokens = "completed", rsp.usage.completion_tokens
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            r.outcome = "refused"
        else:
            r.detail = f"gRPC {e.code().name}: {e.details()}"[:300]
    return r


async def http_stream(session, url: str, plan: Plan, b: Bounds) -> Result:
    r = Result("http", "stream", greedy=plan.greedy)
    body = {"prompt": plan.prompt, "max_tokens": plan.max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0 if plan.greedy is not None else 0.8, "stream_options": {"include_usage": True}}
    start = time.monotonic()
    try:  # the headers come with the first token
        rsp = await within(session.post(f"{url}/v1/completions", json=body), b)
    except Stopped:
        r.outcome, r.detail = "cancelled", "at the end"
        return r
    except Hung as e:
        r.outcome, r.detail = "hung", str(e)
        return r
    async with rsp:
        if rsp.status != 200:
            return _http_refusal(r, rsp.status, await rsp.read(), rsp.headers)
        try:
            await _read_sse(rsp, r, plan, b, start)
        except Hung as e:
            rsp.close()
            r.outcome, r.detail = "hung", str(e)
    if r.outcome not in ("completed", "cancelled", "hung") and not r.detail:
        r.detail = "the stream ended without a finish reason"
    return r


async def _read_sse(rsp, r: Result, plan: Plan, b: Bounds, start: float) -> None:
    first, last, chunks = None, None, 0
    async for line in messages(rsp.content, b):
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            r.outcome, r.detail = "failed", f"in-stream error: {chunk['error']}"[:300]
            break
        if chunk.get("usage"):
            r.tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices") or []:
            chunks += 1
            first, last = first or time.monotonic(), time.monotonic()
            r.text += choice["text"]
            if choice["finish_reason"]:
                r.outcome = "completed"
        if plan.cancel_after is not None and chunks >= plan.cancel_after and r.outcome != "completed":
            rsp.close()  # the client leaves: the connection goes, the server aborts the request
            r.outcome, r.tokens = "cancelled", chunks
            break
    if r.outcome not in ("completed", "cancelled") and not r.detail and b.stop.is_set():
        rsp.close()
        r.outcome, r.tokens, r.detail = "cancelled", chunks, "at the end"
    _timing(r, start, first, last)


async def http_complete(session, url: str, plan: Plan) -> Result:
    r = Result("http", "burst")
    async with session.post(f"{url}/v1/completions", json={"prompt": plan.prompt, "max_tokens": plan.max_tokens,
                                                           "ignore_eos": True}) as rsp:
        body = await rsp.read()
        if rsp.status != 200:
            return _http_refusal(r, rsp.status, body, rsp.headers)
        r.outcome, r.tokens = "completed", json.loads(body)["usage"]["completion_tokens"]
    return r


def _http_refusal(r: Result, status: int, body: bytes, headers) -> Result:
    """503 with an overloaded_error body and Retry-After is a refusal at admission; anything else failed."""
    try:
        kind = json.loads(body)["error"]["type"]
    except (ValueError, KeyError, TypeError):
        kind = None
    if status == 503 and kind == "overloaded_error" and "Retry-After" in headers:
        r.outcome, r.retry_after = "refused", float(headers["Retry-After"])
    else:
        r.outcome, r.detail = "failed", f"HTTP {status}: {body[:200]!r}"
    return r


async def bounded(coro, b: Bounds, proto: str, kind: str, whole: bool = True) -> Result:
    """The request's Result, or a `hung` one when nothing came within the hang bound, or a `failed` one on an
    exception (a dropped connection is an outcome to count, not a crash). whole=False: a stream, which bounds each
    of its messages itself (a long stream whose tokens keep coming is not hung however long it runs)."""
    try:
        return await (within(coro, b) if whole else coro)
    except Hung as e:
        return Result(proto, kind, outcome="hung", detail=str(e))
    except Stopped:
        return Result(proto, kind, outcome="cancelled", detail="at the end")
    except Exception as e:  # noqa: BLE001
        return Result(proto, kind, outcome="failed", detail=f"{type(e).__name__}: {e}"[:300])
