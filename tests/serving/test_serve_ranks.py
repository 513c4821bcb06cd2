"""Replica groups under Ray Serve: one replica of 2 ranks (rank 0 in the LLMServer replica, rank 1 in a Ray actor of
the replica's placement group), one core each, against the single-rank engine alone; every test runs on an app
with torch (gloo) collectives and on one with shm (the default on one node). A killed rank fails the in-flight
stream with UNAVAILABLE; a killed rank, in flight or idle, makes Serve restart the replica with a new group."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
from test_tensor_parallel import PROMPTS, _alive  # the engine's replica-group prompts and liveness check

from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.v1 import inference_pb2 as pb
from cpuserve.v1 import inference_pb2_grpc as pbg

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("serving", [{"transport": "torch"}, {"transport": None}],
                                                       ids=["torch", "shm"], indirect=True, scope="module")]

SERVE_CONFIG = dict(ranks_per_replica=2, cpus_per_rank=1, max_num_seqs=8)
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


def test_killed_rank_fails_the_stream_then_the_replica_restarts(serving, grpc_stub, engine_alone):
    import ray

    (old_name, worker), = rank_workers().items()
    pid = ray.get(worker.where.remote())["pid"]
    call = grpc_stub.Generate(pb.GenerateRequest(text="Write a long story:", sampling=pb.SamplingParameters(
        max_tokens=4000, temperature=0, ignore_eos=True)), timeout=120)
    for _ in range(3):
        next(call)
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
    assert list(recovered.token_ids) == engine_alone.generate([PROMPTS[0]], SamplingParams(**GREEDY))[0].token_ids
    workers = rank_workers()
    assert len(workers) == 1 and old_name not in workers, workers  # one rank actor: the new replica's
    assert ray.get(next(iter(workers.values())).where.remote())["pid"] != old_pid and not _alive(old_pid)
