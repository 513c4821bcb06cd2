"""The operator's Serve config applied in place to a real Ray head through Ray Serve's REST API (with the Ray
token), as on Kubernetes: 8 gRPC streams keep running while an LLMService goes from 1 to 2 replicas, 8 more
while it goes back to 1; every stream completes, and the first replica and the ingress are never restarted."""
from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from control_plane import free_port, wait_for
from cpuserve.operator.serve_api import ServeApi, ServeState, is_deployed, sync
from cpuserve.operator.serve_document import build_serve_document
from cpuserve.operator.settings import OperatorSettings
from cpuserve.operator.validation import validate
from cpuserve.v1 import inference_pb2 as pb
from cpuserve.v1 import inference_pb2_grpc as pbg
from llmservice_factory import make_body
from ray_head import RayHead

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
NUM_STREAMS, NUM_TOKENS = 8, 96


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    ray = RayHead(tmp_path_factory.mktemp("ray") / "ray-head.log")
    try:
        ray.wait_ready()
        yield ray
    finally:
        ray.stop()


def document(replicas: int, ports: dict[str, int]) -> dict:
    body = make_body(replicas=replicas, resources={"cpusPerRank": 1, "kvCacheGb": 0.1}, ports=ports,
                     batching={"maxNumSeqs": 16, "maxQueuedRequests": 32, "maxNumBatchedTokens": 256})
    spec, findings = validate(body, OperatorSettings())
    assert findings == []
    return build_serve_document(spec)


def replicas(api: ServeApi) -> dict[str, list[tuple[str, str]]]:
    """Deployment -> [(replica id, state)] as the head reports them."""
    app = api.details()["applications"].get("cpuserve") or {}
    return {name: [(r["replica_id"], r["state"]) for r in d.get("replicas", [])]
            for name, d in (app.get("deployments") or {}).items()}


def running(api: ServeApi, num: int):
    """The LLMServer replica ids once exactly `num` run and the application is RUNNING, else None."""
    app = api.details()["applications"].get("cpuserve") or {}
    reps = replicas(api).get("LLMServer", [])
    ok = app.get("status") == "RUNNING" and len(reps) == num and all(s == "RUNNING" for _, s in reps)
    return ok and [r for r, _ in reps]


class Stream(threading.Thread):
    """One gRPC Generate stream, greedy, NUM_TOKENS tokens; records when it started and finished."""

    def __init__(self, port: int, i: int):
        super().__init__(daemon=True)
        self.port, self.i = port, i
        self.tokens, self.first_at, self.done_at, self.finish, self.error = 0, None, None, None, None

    def run(self) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = pbg.InferenceStub(channel)
            req = pb.GenerateRequest(text=f"Story {self.i}: once upon a time",
                                     sampling=pb.SamplingParameters(max_tokens=NUM_TOKENS, temperature=0,
                                                                    ignore_eos=True))
            try:
                for rsp in stub.Generate(req, timeout=600):
                    self.tokens += len(rsp.token_ids)
                    self.first_at = self.first_at or time.monotonic()
                    self.finish = rsp.finish_reason or self.finish
            except grpc.RpcError as err:
                self.error = f"{err.code()}: {err.details()}"
        self.done_at = time.monotonic()


def apply(api: ServeApi, doc: dict) -> ServeState:
    """sync() until the head answers (a loaded head may time out one call: the operator retries the same way)."""
    state = wait_for("the head's Serve REST API", lambda: (st := sync(api, doc)).error == "" and st, timeout=120)
    assert is_deployed(api.details(), doc)
    return state


def start_streams(port: int, first: int) -> list[Stream]:
    streams = [Stream(port, first + i) for i in range(NUM_STREAMS)]
    for s in streams:
        s.start()
    wait_for("every stream's first token", lambda: all(s.first_at or s.done_at for s in streams), timeout=300)
    return streams


def test_scaling_in_place_keeps_every_stream(head):
    ports = {"grpc": free_port(), "http": free_port(), "metrics": free_port()}
    api = ServeApi(head.dashboard, head.token)
    with pytest.raises(urllib.error.HTTPError) as info:  # token auth is on: no token, no API
        urllib.request.urlopen(f"{head.dashboard}/api/serve/applications/", timeout=10)
    assert info.value.code == 401

    assert apply(api, document(1, ports)).applied
    (first,) = wait_for("1 replica running", lambda: running(api, 1), timeout=420, interval=1)
    (ingress,) = [r for r, _ in replicas(api)["Ingress"]]
    assert not apply(api, document(1, ports)).applied, "an unchanged spec is not applied again"

    phase_a = start_streams(ports["grpc"], 0)
    scaled_up_at = time.monotonic()
    assert apply(api, document(2, ports)).applied  # 1 -> 2 while phase A streams
    two = wait_for("2 replicas running", lambda: running(api, 2), timeout=420, interval=1)
    assert first in two, "scaling up adds a replica; the running one stays"

    phase_b = start_streams(ports["grpc"], NUM_STREAMS)
    scaled_down_at = time.monotonic()
    assert apply(api, document(1, ports)).applied  # 2 -> 1 while phase B streams: the removed replica drains
    wait_for("back to 1 replica", lambda: running(api, 1), timeout=420, interval=1)
    for s in phase_a + phase_b:
        s.join(600)

    for s in phase_a + phase_b:
        assert s.error is None and s.tokens == NUM_TOKENS and s.finish == pb.FINISH_REASON_LENGTH, vars(s)
    assert all(s.done_at > scaled_up_at for s in phase_a), "phase A streams ran across the scale-up"
    assert all(s.done_at > scaled_down_at for s in phase_b), "phase B streams ran across the scale-down"
    assert [r for r, _ in replicas(api)["Ingress"]] == [ingress], "the ingress was never restarted"
