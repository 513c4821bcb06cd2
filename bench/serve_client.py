"""The one neutral client of bench/serving.py: every server gets the same requests and is timed the same way.

OpenAI-compatible servers get streaming /v1/completions with the prompt as token ids, `max_tokens`, temperature 0,
`stream_options.include_usage` and each server's own way of never stopping early (`extra`). cpuserve's gRPC gets
the same request as a Generate stream. Output tokens are counted from the server's usage (the last chunk), never
from chunks; TTFT is the time to the first chunk that carries text or tokens. A request that fails, or that ends
without usage, counts as failed, with its reason kept.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Level:
    """One concurrency level: each finished request's TTFT, output tokens and streamed messages (when its sender
    counts them), and why the others failed."""
    concurrency: int
    max_tokens: int
    wall: float = 0.0
    ttft: list[float] = field(default_factory=list)  # seconds
    tokens: list[int] = field(default_factory=list)
    messages: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def row(self) -> dict:
        """Output tokens/s over the level's wall time and TTFT percentiles in ms (vllm bench serve's figures)."""
        pct = (lambda q: float(np.percentile(self.ttft, q)) * 1e3) if self.ttft else (lambda q: float("nan"))
        return {"tok_s": sum(self.tokens) / self.wall if self.wall else 0.0, "ttft_p50": pct(50),
                "ttft_p99": pct(99), "done": len(self.tokens), "failed": len(self.errors),
                "short": sum(t != self.max_tokens for t in self.tokens),  # ignore-eos not honoured
                "error": self.errors[0] if self.errors else ""}


async def run_level(send, prompts: list[list[int]], concurrency: int, max_tokens: int) -> Level:
    """Send every prompt, at most `concurrency` in flight; send(prompt, max_tokens) -> (ttft s, output tokens) or
    (ttft s, output tokens, streamed messages)."""
    level, gate = Level(concurrency, max_tokens), asyncio.Semaphore(concurrency)

    async def one(p):
        async with gate:
            try:
                ttft, tokens, *messages = await send(p, max_tokens)
            except Exception as e:  # noqa: BLE001 - a failed request is a figure of the row, not a crash
                level.errors.append(f"{type(e).__name__}: {str(e)[:200]}")
                return
            level.ttft.append(ttft)
            level.tokens.append(tokens)
            level.messages += messages

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    level.wall = time.perf_counter() - start
    return level


def openai_sender(session, base_url: str, model: str | None, extra: dict):
    """send() for an OpenAI-compatible server over an aiohttp session, the HTTP client of `vllm bench serve` (at 32
    streams it took 16 us of CPU per token where httpx took 46, and it shares the servers' cores); `extra`: the
    server's fields for ignore-eos (and anything it needs)."""
    async def send(prompt: list[int], max_tokens: int) -> tuple[float, int, int]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, **extra}
        if model:
            body["model"] = model
        start, ttft, usage, events = time.perf_counter(), None, None, 0
        async with session.post(f"{base_url}/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.read())[:200]!r}")
            async for line in r.content:  # one SSE line at a time
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                events += bool(chunk.get("choices"))  # a message of tokens (not the closing usage event)
                if ttft is None and any(c.get("text") for c in chunk.get("choices") or []):
                    ttft = time.perf_counter() - start
                usage = chunk.get("usage") or usage
        if usage is None or ttft is None:
            raise RuntimeError("the stream ended without " + ("usage" if ttft is not None else "any text"))
        return ttft, usage["completion_tokens"], events

    return send


def grpc_sender(stub, pb):
    """send() for cpuserve's gRPC Generate stream: the same request, tokens from the last message's usage."""
    async def send(prompt: list[int], max_tokens: int) -> tuple[float, int, int]:
        sampling = pb.SamplingParameters(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)
        start, ttft, usage, responses = time.perf_counter(), None, None, 0
        async for r in stub.Generate(request):
            responses += 1
            if ttft is None and r.token_ids:
                ttft = time.perf_counter() - start
            if r.HasField("usage"):
                usage = r.usage
        if usage is None or ttft is None:
            raise RuntimeError("the stream ended without " + ("usage" if ttft is not None else "any token"))
        return ttft, usage.completion_tokens, responses

    return send
