"""Metrics match real traffic; cancelled streams, gone clients and gRPC deadlines free the KV pool;
past the waiting limit (requests, or queued prompt tokens) new requests get 503 with Retry-After / RESOURCE_EXHAUSTED
at once, counted by the limit they met, and admitted ones are served. One replica, real SmolLM2."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest

from cpuserve.v1 import inference_pb2 as pb
from cpuserve.v1 import inference_pb2_grpc as pbg

pytestmark = pytest.mark.slow

# admission: 4 running + 4 waiting in flight, the 9th is refused; 1000 prompt tokens waiting at most
SERVE_CONFIG = dict(max_num_seqs=4, max_queued_requests=4, max_queued_tokens=1000)
M = 'model="SmolLM2-135M-Instruct"'
LONG = pb.SamplingParameters(max_tokens=4000, temperature=0, ignore_eos=True)


def value(metrics: dict[str, float], name: str, labels: str = M) -> float:
    return metrics.get(f"{name}{{{labels}}}", 0.0)


def wait_for(scrape, predicate, timeout: float = 30.0) -> dict[str, float]:
    """Scrape until predicate(metrics) holds (replicas report every 0.25 s here; on a loaded CI machine Ray's
    cancellation can take seconds to reach the replica, so the bound is generous — it returns at once when met)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape()
        if predicate(metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def pool_is_free(metrics: dict[str, float]) -> bool:
    return (value(metrics, "cpuserve_kv_cache_usage_ratio") == 0 and value(metrics, "cpuserve_num_requests_running") == 0
            and value(metrics, "cpuserve_num_requests_waiting") == 0)


def test_metrics_match_traffic(grpc_stub, http_url, scrape):
    before = scrape()
    # the greedy first token of this prompt, then a request that stops on it: finish reason "stop"
    prompt = "The three primary colours are"
    first = grpc_stub.Complete(pb.GenerateRequest(text=prompt, sampling=pb.SamplingParameters(
        max_tokens=1, temperature=0))).token_ids[0]
    stop = grpc_stub.Complete(pb.GenerateRequest(text=prompt, sampling=pb.SamplingParameters(
        max_tokens=10, temperature=0, stop_token_ids=[first])))
    streamed = list(grpc_stub.Generate(pb.GenerateRequest(text="Tell me about", sampling=pb.SamplingParameters(
        max_tokens=9, temperature=0, ignore_eos=True))))
    http = httpx.post(f"{http_url}/v1/completions", json={"prompt": "Hello there", "max_tokens": 6,
                                                          "temperature": 0, "ignore_eos": True}, timeout=60).json()
    usages = [(1, None), (stop.usage.completion_tokens, stop.usage.prompt_tokens),
              (streamed[-1].usage.completion_tokens, streamed[-1].usage.prompt_tokens),
              (http["usage"]["completion_tokens"], http["usage"]["prompt_tokens"])]
    assert stop.finish_reason == pb.FINISH_REASON_STOP and [u[0] for u in usages] == [1, 1, 9, 6]
    prompt_tokens = 2 * stop.usage.prompt_tokens + usages[2][1] + usages[3][1]
    # the replica reports its steps and its pool together every 0.25 s; a report may come between the last step
    # and the finished request's blocks going back (seen under load): wait for both
    after = wait_for(scrape, lambda m: value(m, "cpuserve_engine_step_seconds_count", M + ',rank="0"')
                     - value(before, "cpuserve_engine_step_seconds_count", M + ',rank="0"') >= 1 + 1 + 9 + 6
                     and pool_is_free(m))

    def delta(name: str, labels: str = M) -> float:
        return value(after, name, labels) - value(before, name, labels)

    assert delta("cpuserve_requests_total", 'finish_reason="length",' + M) == 3
    assert delta("cpuserve_requests_total", 'finish_reason="stop",' + M) == 1
    assert delta("cpuserve_requests_total", 'finish_reason="abort",' + M) == 0
    assert delta("cpuserve_prompt_tokens_total") == prompt_tokens
    assert delta("cpuserve_generation_tokens_total") == 1 + 1 + 9 + 6
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert delta(f"cpuserve_{histogram}_seconds_count") == 4, histogram
    assert delta("cpuserve_inter_token_latency_seconds_count") == (1 + 1 + 9 + 6) - 4
    assert 0 < delta("cpuserve_time_to_first_token_seconds_sum") <= delta("cpuserve_e2e_request_latency_seconds_sum")
    assert delta("cpuserve_engine_step_seconds_count", M + ',rank="0"') >= 17  # at least one step per token
    assert delta("cpuserve_preemptions_total") == 0
    assert pool_is_free(after)


def test_gauges_show_a_running_request(serving, grpc_stub, scrape):
    call = grpc_stub.Generate(pb.GenerateRequest(text="Count slowly:", sampling=LONG))
    next(call)
    busy = wait_for(scrape, lambda m: value(m, "cpuserve_num_requests_running") == 1)
    call.cancel()
    assert value(busy, "cpuserve_num_requests_running") == 1
    assert value(busy, "cpuserve_kv_cache_usage_ratio") > 0
    assert pool_is_free(wait_for(scrape, pool_is_free))


def test_grpc_cancel_frees_the_pool(grpc_stub, scrape):
    before = scrape()
    call = grpc_stub.Generate(pb.GenerateRequest(text="Write a long story:", sampling=LONG))
    for _ in range(3):
        next(call)
    call.cancel()
    aborts = 'finish_reason="abort",' + M
    # Ray cancels the replica's call and the ingress's own generator concurrently: wait for both
    after = wait_for(scrape, lambda m: pool_is_free(m) and value(m, "cpuserve_requests_total", aborts) > value(
        before, "cpuserve_requests_total", aborts))
    assert pool_is_free(after), after
    assert value(after, "cpuserve_requests_total", aborts) - value(before, "cpuserve_requests_total", aborts) == 1


def test_http_client_disconnect_frees_the_pool(http_url, scrape):
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{http_url}/v1/completions", json={
                "prompt": "Write a long story:", "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
                "stream": True}) as response:
            lines = response.iter_lines()
            assert sum(1 for line, _ in zip(lines, range(6)) if line.startswith("data: ")) >= 3
    # the connection is closed: the proxy cancels the request, the replica aborts it
    assert pool_is_free(wait_for(scrape, pool_is_free)), scrape()


def test_grpc_deadline_is_honoured_and_frees_the_pool(grpc_stub, scrape):
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(grpc_stub.Generate(pb.GenerateRequest(text="Write a long story:", sampling=LONG), timeout=1.0))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 3
    assert pool_is_free(wait_for(scrape, pool_is_free)), scrape()


def test_backpressure_rejects_at_once_then_recovers(serving, http_url, scrape):
    before = scrape()

    async def scenario():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{serving.grpc_port}") as channel:
            stub = pbg.InferenceStub(channel)
            calls = [stub.Generate(pb.GenerateRequest(text=f"Story {i}:", sampling=LONG)) for i in range(8)]
            # 4 run, the other 4 wait in the engine's queue (which 4 is up to the scheduler)
            loop = asyncio.get_running_loop()
            full = await loop.run_in_executor(None, lambda: wait_for(scrape, lambda m: value(
                m, "cpuserve_num_requests_running") == 4 and value(m, "cpuserve_num_requests_waiting") == 4, 20))
            rejected, took = [], []
            for _ in range(20):  # a burst past the limit: each refused immediately, none queued
                start = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Complete(pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(max_tokens=1)))
                took.append(time.monotonic() - start)
                rejected.append(info.value.code())
            async with httpx.AsyncClient(timeout=30) as client:
                r = await client.post(f"{http_url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            for call in calls:
                call.cancel()
            return rejected, took, r, full

    rejected, took, http_response, busy = asyncio.run(scenario())
    assert set(rejected) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert max(took) < 0.5, took
    assert http_response.status_code == 503 and http_response.json()["error"]["type"] == "overloaded_error"
    assert http_response.headers["retry-after"] == "1"
    limit = 'limit="requests",' + M
    assert value(scrape(), "cpuserve_requests_refused_total", limit) - value(
        before, "cpuserve_requests_refused_total", limit) == 21
    assert value(busy, "cpuserve_num_requests_running") == 4 and value(busy, "cpuserve_num_requests_waiting") == 4
    assert pool_is_free(wait_for(scrape, pool_is_free)), scrape()
    r = httpx.post(f"{http_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_queued_prompt_tokens_are_bounded_and_admitted_requests_served(serving, http_url, scrape):
    """4 long streams fill the batch; a 700-token prompt then waits (admitted), a second would make 1400 queued
    tokens, past max_queued_tokens=1000: refused at once over HTTP (503, Retry-After) and gRPC; the waiting one is
    served in full once the batch frees."""
    before = scrape()
    prompt = "one two three four five six seven " * 100  # 701 tokens with BOS

    async def scenario():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{serving.grpc_port}") as channel:
            stub = pbg.InferenceStub(channel)
            calls = [stub.Generate(pb.GenerateRequest(text=f"Story {i}:", sampling=LONG)) for i in range(4)]
            for call in calls:
                await call.read()  # running
            waiting = asyncio.ensure_future(stub.Complete(pb.GenerateRequest(
                text=prompt, sampling=pb.SamplingParameters(max_tokens=3, temperature=0))))
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, lambda: wait_for(scrape, lambda m: value(
                m, "cpuserve_num_requests_waiting") == 1, 20))
            async with httpx.AsyncClient(timeout=30) as client:
                refused = await client.post(f"{http_url}/v1/completions", json={"prompt": prompt, "max_tokens": 3})
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Complete(pb.GenerateRequest(text=prompt, sampling=pb.SamplingParameters(max_tokens=3)))
            for call in calls:
                call.cancel()
            return refused, info.value, await waiting

    refused, error, served = asyncio.run(scenario())
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1, refused.text
    assert "max_queued_tokens=1000" in refused.json()["error"]["message"]
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queued_tokens" in error.details()
    assert served.usage.completion_tokens == 3 and served.usage.prompt_tokens > 500
    limit = 'limit="tokens",' + M
    assert value(scrape(), "cpuserve_requests_refused_total", limit) - value(
        before, "cpuserve_requests_refused_total", limit) == 2
    assert pool_is_free(wait_for(scrape, pool_is_free)), scrape()
