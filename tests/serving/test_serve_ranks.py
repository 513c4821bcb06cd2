"""Replica groups under Ray Serve: one replica of 2 ranks (rank 0 in the LLMServer replica, rank 1 in a Ray actor of
the replica's placement group), one core each, against the single-rank engine alone; every test runs on an app
with torch (gloo) collectives and on one with shm (the default on one node). A killed rank fails the in-flight
stream with UNAVAILABLE; a killed rank, in flight or idle, makes Serve restart the replica with a new group."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import grpc
import httpx
import pytest
from test_tensor_parallel import PROMPTS, _alive  # the engine's replica-group prompts and liveness check

from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.v1 import inference_pb2 as pb
from cpuserve.v1 import inference_pb2_grpc as pbg

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("serving", [{"transport": "torch"}, {"transport": None}],
                                                       ids=["torch", "shm"], indirect=True, scope="module")]

SERVE_CONFIG = dict(ranks_per_replica=2, cpus_per_rank=1, max_num_seqs=8, health_timeout_s=5)
GREEDY = dict(max_tokens=16, temperature=0, ignore_eos=True)
RECOVERY_TIMEOUT = 120.0


def rank_workers() -> dict[str, object]:
    """The live rank actors of every replica, by name (cpuserve-<replica>-rank<r>)."""
    import ray

    return {a["name"]: ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("cpuserve-") and "-rank" in a["name"]}


def complete_all(port: int, requests: list[pb.GenerateRequest]) -> list[pb.CompleteResponse]:
    """All requests at once over one channel, so the group runs them as one batch."""
    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pbg.InferenceStub(channel)
            return await asyncio.gather(*(stub.Complete(r, timeout=300) for r in requests))

    return asyncio.run(run())


def served_and_alone(serving, engine_alone, prompts: list[str], **sampling) -> tuple[list, list]:
    served = complete_all(serving.grpc_port, [pb.GenerateRequest(text=p, sampling=pb.SamplingParameters(**sampling))
                                              for p in prompts])
    alone = engine_alone.generate(prompts, SamplingParams(**sampling))
    return [list(r.token_ids) for r in served], [r.token_ids for r in alone]


def test_greedy_tokens_identical_to_one_rank(serving, engine_alone):
    served, alone = served_and_alone(serving, engine_alone, PROMPTS, **GREEDY)
    assert served == alone
    assert len(rank_workers()) == 1  # the replica's rank 1 runs in its own actor


@pytest.mark.parametrize("sampling", [dict(temperature=0.9, top_p=0.95, seed=11),  # rank 0 gathers full shards
                                      dict(temperature=0.9, top_k=40, seed=12)],  # reduced top-k candidates
                         ids=["top_p", "top_k"])
def test_seeded_sampling_identical_to_one_rank(serving, engine_alone, sampling):
    served, alone = served_and_alone(serving, engine_alone, PROMPTS[:4], max_tokens=16, **sampling)
    assert served == alone


def test_killed_rank_fails_the_stream_then_the_replica_restarts(serving, grpc_stub, http_url, engine_alone):
    import ray

    (old_name, worker), = rank_workers().items()
    pid = ray.get(worker.where.remote())["pid"]
    call = grpc_stub.Generate(pb.GenerateRequest(text="Write a long story:", sampling=pb.SamplingParameters(
        max_tokens=4000, temperature=0, ignore_eos=True)), timeout=120)
    for _ in range(3):
        next(call)
    plain: dict = {}  # a non-streamed HTTP request in flight too: its answer is a 503
    thread = threading.Thread(target=lambda: plain.update(rsp=httpx.post(f"{http_url}/v1/completions", timeout=120, json={
        "prompt": "Write a long story:", "max_tokens": 4000, "ignore_eos": True})), daemon=True)
    thread.start()
    time.sleep(1.0)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    failed = time.monotonic() - killed
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    details = info.value.details()
    assert "RankFailedError" in details and "retry" in details, details
    assert ("torch.distributed" if serving.transport == "torch" else "rank 1 (pid") in details, details
    assert failed < 30, f"the stream took {failed:.1f} s to fail"
    thread.join(60)
    error = plain["rsp"].json()["error"]
    assert plain["rsp"].status_code == 503 and "RankFailedError" in error["message"], plain["rsp"].text

    # Serve's health check fails the replica and starts a new one (new placement group, new rank actor)
    assert_recovers(grpc_stub, engine_alone, killed, old_name, pid)


def test_rank_killed_while_idle_restarts_the_replica(serving, grpc_stub, engine_alone):
    """No request notices: the replica's health check sees the dead worker and Serve replaces the replica."""
    import ray

    (old_name, worker), = rank_workers().items()
    pid = ray.get(worker.where.remote())["pid"]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while old_name in rank_workers() or not rank_workers():  # replaced before any request is sent
        assert time.monotonic() - killed < RECOVERY_TIMEOUT, "the replica was not replaced"
        time.sleep(1)
    assert_recovers(grpc_stub, engine_alone, killed, old_name, pid)


def assert_recovers(grpc_stub, engine_alone, killed: float, old_name: str, old_pid: int) -> None:
    """Within RECOVERY_TIMEOUT of the kill a request succeeds, with one-rank tokens, on a new rank actor."""
    import ray

    request = pb.GenerateRequest(text=PROMPTS[0], sampling=pb.SamplingParameters(**GREEDY))
    while True:
        try:
            recovered = grpc_stub.Complete(request, timeout=30)
            break
        except grpc.RpcError as e:
            assert time.monotonic() - killed < RECOVERY_TIMEOUT, f"not serving again: {e.code()} {e.details()}"
            time.sleep(1)
    print(f"serving again {time.monotonic() - killed:.1f} s after the fault")
    assert list(recovered.token_ids) == engine_alone.generate([PROMPTS[0]], SamplingParams(**GREEDY))[0].token_ids
    workers = rank_workers()
    assert len(workers) == 1 and old_name not in workers, workers  # one rank actor: the new replica's
    assert ray.get(next(iter(workers.values())).where.remote())["pid"] != old_pid and not _alive(old_pid)


HEALTH_TIMEOUT_S = 5.0  # the app's health_timeout_s (SERVE_CONFIG)


def health_round(url: str, n: int) -> list[tuple[int, float, str]]:
    """n /health probes at once: (status, seconds, message) each."""
    import httpx

    async def one(client):
        start = time.monotonic()
        rsp = await client.get(f"{url}/health", timeout=120)
        return rsp.status_code, time.monotonic() - start, rsp.json()["message"]

    async def run():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client) for _ in range(n)))

    return asyncio.run(run())


def test_a_stalled_step_fails_health_fast_and_probes_do_not_pile_up(serving, grpc_stub, http_url, scrape,
                                                                    engine_alone):
    """Rank 1 stopped (SIGSTOP): rank 0's next step waits in a collective. /health's probe runs a one-token generation,
    gives up after health_timeout_s and answers 503; the probes after it answer at once from the stalled step, and
    the engine never holds more than the one probe; Serve's health check replaces the replica, which serves again."""
    import ray

    if serving.transport == "torch":
        pytest.skip("the probe does not depend on the transport (a stopped rank stalls both): run on shm only")
    (old_name, worker), = rank_workers().items()
    pid = ray.get(worker.where.remote())["pid"]
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        first = health_round(http_url, 10)  # the engine is idle: these share one real probe, which stalls
        assert [s for s, *_ in first] == [503] * 10, first
        assert max(t for _, t, _ in first) < HEALTH_TIMEOUT_S + 10, first
        later = health_round(http_url, 10)
        assert [s for s, *_ in later] == [503] * 10 and max(t for _, t, _ in later) < 5, later
        assert "stalled" in later[0][2] or "no token" in later[0][2], later[0]
        m = scrape()
        queued = sum(m.get(f'cpuserve_num_requests_{k}{{model="SmolLM2-135M-Instruct"}}', 0)
                     for k in ("running", "waiting"))
        assert queued <= 1, m  # one probe request at most, however many probes came
        health = grpc_stub.Health(pb.HealthRequest(), timeout=30)
        assert health.status == pb.SERVING_STATUS_NOT_SERVING, health
        print(f"stalled step: first probes {max(t for _, t, _ in first):.1f} s, later ones "
              f"{max(t for _, t, _ in later):.2f} s; {first[0][2]!r} / {later[0][2]!r}")
        while old_name in rank_workers():  # Serve's own health check fails the stalled replica and replaces it
            assert time.monotonic() - stopped < RECOVERY_TIMEOUT, "the stalled replica was not replaced"
            time.sleep(1)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGCONT)
    assert_recovers(grpc_stub, engine_alone, stopped, old_name, pid)
