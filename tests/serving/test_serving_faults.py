"""Faults during traffic on one single-rank replica (real Ray Serve, real SmolLM2): the LLMServer replica's process
killed while requests run, and a KV pool too small for the prompts sent at once. Every client gets an answer (a
result, or 503 / UNAVAILABLE with a message), none hangs. (A killed rank and a stalled step: test_serve_ranks.py.)"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import grpc
import httpx
import psutil
import pytest

from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.v1 import inference_pb2 as pb
from cpuserve.v1 import inference_pb2_grpc as pbg

pytestmark = pytest.mark.slow

# 0.02 GiB of int8 KV is about 1700 tokens of SmolLM2 (12.3 KB a token): two of the long prompts below at a time
SERVE_CONFIG = dict(kv_cache_gb=0.02, max_num_seqs=8)
M = 'model="SmolLM2-135M-Instruct"'
RECOVERY_BOUND_S = 90.0  # measured on the Xeon (2 busy cores): serving again 9-15 s after the kill
# measured on the Xeon (2 cores, busy): the last of the six got its first token after 9.1 s, all were done in 10 s
WAIT_BOUND_S = 60.0
CLIENT_TIMEOUT_S = 120.0  # no client waits longer; a hang shows as this timeout, which the tests refuse


def replica_pids() -> list[int]:
    """The LLMServer replicas' processes of this test's Ray cluster (children of this process's raylet)."""
    return [p.pid for p in psutil.Process().children(recursive=True)
            if "ServeReplica:cpuserve:LLMServer" in " ".join(_cmdline(p))]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


class SSE(threading.Thread):
    """A streamed HTTP completion read in a thread: `tokens` seen, `error` (the in-stream error event) or `status`."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body, self.tokens, self.error, self.status = url, body, 0, None, None
        self.started = threading.Event()
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", f"{self.url}/v1/completions", json={**self.body, "stream": True},
                          timeout=CLIENT_TIMEOUT_S) as rsp:
            self.status = rsp.status_code
            for line in rsp.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.error = chunk["error"]
                    else:
                        self.tokens += 1
                        self.started.set()
        self.started.set()


def test_a_killed_replica_process_fails_its_requests_then_serves_again(serving, http_url, grpc_stub):
    """kill -9 of the LLMServer replica while a gRPC stream, an SSE stream and a non-streamed HTTP request run: each
    ends with UNAVAILABLE / 503 and a message saying to retry; Serve starts a new replica process and requests
    succeed again within RECOVERY_BOUND_S; no client waits for its timeout."""
    (pid,) = replica_pids()
    long = dict(prompt="Write a long story:", max_tokens=3000, temperature=0, ignore_eos=True)
    stream = grpc_stub.Generate(pb.GenerateRequest(text=long["prompt"], sampling=pb.SamplingParameters(
        max_tokens=3000, temperature=0, ignore_eos=True)), timeout=CLIENT_TIMEOUT_S)
    next(stream)
    sse = SSE(http_url, long)
    assert sse.started.wait(60) and sse.tokens, "the SSE stream did not start"
    unary: dict = {}
    plain = threading.Thread(target=lambda: unary.update(rsp=httpx.post(f"{http_url}/v1/completions", json=long,
                                                                        timeout=CLIENT_TIMEOUT_S)), daemon=True)
    plain.start()
    time.sleep(1.0)  # the unary request reaches the replica
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()

    with pytest.raises(grpc.RpcError) as info:
        for _ in stream:
            pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (info.value.code(), info.value.details())
    assert "retry" in info.value.details(), info.value.details()
    sse.join(CLIENT_TIMEOUT_S)
    assert sse.status == 200 and sse.error is not None and sse.error["type"] == "server_error", (sse.status, sse.error)
    plain.join(CLIENT_TIMEOUT_S)
    rsp = unary["rsp"]
    assert rsp.status_code == 503 and rsp.json()["error"]["type"] == "server_error", rsp.text
    failed = time.monotonic() - killed
    assert failed < 30, f"the requests took {failed:.1f} s to fail"

    attempts = []
    while True:  # every attempt gets an answer: success, or 503 / UNAVAILABLE while the new replica starts
        start = time.monotonic()
        try:
            done = grpc_stub.Complete(pb.GenerateRequest(text="Hi", sampling=pb.SamplingParameters(max_tokens=4)),
                                      timeout=60)
            break
        except grpc.RpcError as e:
            attempts.append((e.code(), round(time.monotonic() - start, 1), e.details()[:200]))
            assert e.code() != grpc.StatusCode.DEADLINE_EXCEEDED, attempts
            assert time.monotonic() - killed < RECOVERY_BOUND_S, f"not serving again: {attempts}"
            time.sleep(0.5)
    recovered = time.monotonic() - killed
    print(f"replica killed: requests failed after {failed:.1f} s, serving again after {recovered:.1f} s; "
          f"attempts in between: {attempts}")
    assert done.usage.completion_tokens == 4
    assert replica_pids() and pid not in replica_pids()


def long_prompt(i: int) -> str:
    # distinct from the first token on, so no two prompts share a cached block
    return f"Note {i}. " + " ".join(f"item {i * 1000 + k} is {'red' if k % 3 else 'blue'};" for k in range(120))


async def _generate_timed(stub, request: pb.GenerateRequest, delay: float) -> dict:
    await asyncio.sleep(delay)
    sent = time.monotonic()
    out = {"sent": sent, "first": None, "ids": []}
    async for rsp in stub.Generate(request, timeout=CLIENT_TIMEOUT_S):
        out["first"] = out["first"] or time.monotonic()
        out["ids"] += list(rsp.token_ids)
        if rsp.finish_reason:
            out["finish"] = rsp.finish_reason
    out["end"] = time.monotonic()
    return out


def test_a_full_kv_pool_preempts_and_serves_every_request(serving, scrape, engine_alone):
    """Six prompts of ~900 tokens sent 50 ms apart into a pool that holds about two: the scheduler preempts
    (recompute), every request completes with the tokens the engine alone gives, and requests start in the order
    they came (the oldest waiting one is served first; none waits behind a later one)."""
    prompts = [long_prompt(i) for i in range(6)]
    sampling = dict(max_tokens=48, temperature=0, ignore_eos=True)
    before = scrape()

    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{serving.grpc_port}") as channel:
            stub = pbg.InferenceStub(channel)
            return await asyncio.gather(*(
                _generate_timed(stub, pb.GenerateRequest(text=p, sampling=pb.SamplingParameters(**sampling)), 0.05 * i)
                for i, p in enumerate(prompts)))

    start = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - start
    after = scrape()
    preempted = after.get(f"cpuserve_preemptions_total{{{M}}}", 0) - before.get(f"cpuserve_preemptions_total{{{M}}}", 0)
    assert preempted > 0, "the pool did not run out: make the prompts longer or the pool smaller"
    assert [r["finish"] for r in results] == [pb.FINISH_REASON_LENGTH] * len(prompts)
    alone = engine_alone.generate([prompts[0], prompts[-1]], SamplingParams(**sampling))
    assert [results[0]["ids"], results[-1]["ids"]] == [a.token_ids for a in alone]  # preemption lost no token
    firsts = [r["first"] for r in results]
    assert firsts == sorted(firsts), [round(f - start, 2) for f in firsts]  # FCFS: no later request started first
    waits = [r["first"] - r["sent"] for r in results]
    print(f"KV pool full: {preempted:g} preemptions, {elapsed:.1f} s for all; time to first token "
          f"{[round(w, 1) for w in waits]} s")
    assert max(waits) < WAIT_BOUND_S, waits
