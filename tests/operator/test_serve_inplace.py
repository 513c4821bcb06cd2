"""The operator's Serve config applied in place to a real Ray head through Ray Serve's REST API (with the Ray
token), as on Kubernetes: 8 gRPC streams keep running while an LLMService goes from 1 to 2 replicas, 8 more
while it goes back to 1; every stream completes, and the first replica and the ingress are never restarted.
Then the model and its weights' format change on the one replica: 8 streams run through it and complete, a probe
every 0.2 s is answered throughout (a new replica is serving before the old one stops, the ingress stays), and
requests after it get the new model."""
from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

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
from serve_load import change_under_load, replicas, running, start_streams

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


@pytest.fixture(scope="module")
def ports():
    """The proxies' ports: Serve starts its proxies once, on the first config's ports."""
    return {"grpc": free_port(), "http": free_port(), "metrics": free_port()}


def document(replicas: int, ports: dict[str, int], weights: str = "int4", model: Path | None = None) -> dict:
    body = make_body(replicas=replicas, resources={"cpusPerRank": 1, "kvCacheGb": 0.1}, ports=ports,
                     quantization={"weights": weights},
                     batching={"maxNumSeqs": 16, "maxQueuedRequests": 32, "maxNumBatchedTokens": 256})
    spec, findings = validate(body, OperatorSettings())
    assert findings == []
    doc = build_serve_document(spec)
    if model is not None:  # a model file of this machine (a pod's would be under /models)
        doc["applications"][1]["args"]["model"] = str(model)
    return doc


def apply(api: ServeApi, doc: dict) -> ServeState:
    """sync() until the head answers (a loaded head may time out one call: the operator retries the same way)."""
    state = wait_for("the head's Serve REST API", lambda: (st := sync(api, doc)).error == "" and st, timeout=120)
    assert is_deployed(api.details(), doc)
    return state


def test_scaling_in_place_keeps_every_stream(head, ports):
    api = ServeApi(head.dashboard, head.token)
    with pytest.raises(urllib.error.HTTPError) as info:  # token auth is on: no token, no API
        urllib.request.urlopen(f"{head.dashboard}/api/serve/applications/", timeout=10)
    assert info.value.code == 401

    assert apply(api, document(1, ports)).applied
    (first,) = wait_for("1 replica running", lambda: running(api, 1), timeout=420, interval=1)
    (ingress,) = [r for r, _ in replicas(api)["Ingress"]]
    assert not apply(api, document(1, ports)).applied, "an unchanged spec is not applied again"

    phase_a = start_streams(ports["grpc"], 0, NUM_STREAMS, NUM_TOKENS)
    scaled_up_at = time.monotonic()
    assert apply(api, document(2, ports)).applied  # 1 -> 2 while phase A streams
    two = wait_for("2 replicas running", lambda: running(api, 2), timeout=420, interval=1)
    assert first in two, "scaling up adds a replica; the running one stays"

    # phase B must be in flight when the scale-down is applied. Under a loaded machine a stream can finish its
    # tokens before the slowest one's first token comes (start_streams waits for that): such a set ran on 2 replicas
    # only, so it is left to complete and a new set is started (up to 3 sets)
    early = []
    for attempt in range(3):
        phase_b = start_streams(ports["grpc"], NUM_STREAMS * (1 + attempt), NUM_STREAMS, NUM_TOKENS)
        if not any(s.done_at for s in phase_b):
            break
        early += phase_b
    else:
        pytest.fail(f"3 sets of {NUM_STREAMS} streams each had one done before the last one's first token")
    scaled_down_at = time.monotonic()
    assert apply(api, document(1, ports)).applied  # 2 -> 1 while phase B streams: the removed replica drains
    wait_for("back to 1 replica", lambda: running(api, 1), timeout=420, interval=1)
    for s in phase_a + early + phase_b:
        s.join(600)

    for s in phase_a + early + phase_b:
        assert s.completed, vars(s)
    assert all(s.done_at > scaled_up_at for s in phase_a), "phase A streams ran across the scale-up"
    assert all(s.done_at > scaled_down_at for s in phase_b), "phase B streams ran across the scale-down"
    assert [r for r, _ in replicas(api)["Ingress"]] == [ingress], "the ingress was never restarted"


def test_a_model_change_keeps_serving_throughout(head, ports, tmp_path):
    from cpuserve.engine.loader import default_model_path
    from cpuserve.serving.config import DEFAULT_MODEL_NAME
    from cpuserve.serving.telemetry import STALE_AFTER_S

    api = ServeApi(head.dashboard, head.token)
    apply(api, document(1, ports))
    wait_for("1 replica running", lambda: running(api, 1), timeout=420, interval=1)
    new_model = tmp_path / "smollm2-b.gguf"  # the same weights under another name: another model to Serve
    new_model.symlink_to(default_model_path())
    change_under_load(api, ports["grpc"], lambda: apply(api, document(1, ports, weights="int8", model=new_model)),
                      NUM_STREAMS, NUM_TOKENS, "model change")
    with grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}") as channel:  # requests after it: the new model
        stub = pbg.InferenceStub(channel)
        # the old replica's last report counts for STALE_AFTER_S after it stopped
        (info,) = wait_for("the new model alone", lambda: len(
            m := stub.ListModels(pb.ListModelsRequest(), timeout=30).models) == 1 and m, timeout=STALE_AFTER_S + 10)
        assert (info.name, info.weights) == ("smollm2-b", "int8")
        reply = stub.Complete(pb.GenerateRequest(model="smollm2-b", text="Hi",
                                                 sampling=pb.SamplingParameters(max_tokens=4)), timeout=60)
        assert reply.usage.completion_tokens == 4
        with pytest.raises(grpc.RpcError) as gone:
            stub.Complete(pb.GenerateRequest(model=DEFAULT_MODEL_NAME, text="Hi"), timeout=60)
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND and "smollm2-b" in gone.value.details()
