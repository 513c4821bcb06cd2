"""The serving path without Ray and without a model, in milliseconds: IngressCore -> LocalHandle (the in-process
DeploymentHandle of serving/local_handle.py) -> LLMServer(engine_cls=FakeEngine). Bad input gets HTTP 4xx / a gRPC
status naming the field, past the admission limit requests get 429 / RESOURCE_EXHAUSTED, a dead engine 503 /
UNAVAILABLE. (The same through the real stack: test_serving_bad_input.py, test_serving_metrics_cancel.py.)"""

from __future__ import annotations

import asyncio
import json
import pickle
import subprocess
import sys
import time
from typing import Any

import grpc
import pytest
from starlette.requests import Request

from cpuserve.engine.errors import EngineDeadError, InvalidRequest
from cpuserve.engine.outputs import StepOutput
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.serving.config import ServeConfig
from cpuserve.serving.ingress import IngressCore
from cpuserve.serving.local_handle import LocalHandle
from cpuserve.serving.llm_server import LLMServer
from cpuserve.serving.protocol import GenerateRequest, RequestError
from cpuserve.v1 import inference_pb2 as pb

MAX_MODEL_LEN = 64
VOCAB_SIZE = 1000


class FakeTokenizer:
    """One token per character."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % VOCAB_SIZE for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


class FakeEngine:
    """AsyncLLMEngine's interface: validates like the engine (InvalidRequest), then streams "x" per token. With
    `hold` set, streams wait on `release` after their first token (requests in flight, for the admission test),
    with `hold_first` before it (requests queued); `dead` fails every request."""

    hold = False
    hold_first = False
    dead = False
    stalled_s = 0.0  # what seconds_without_progress says

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.max_model_len = MAX_MODEL_LEN
        self.num_streams = 0
        self.num_generate = 0  # requests started
        self.release = asyncio.Event()

    def seconds_without_progress(self) -> float:
        return self.stalled_s

    @classmethod
    def from_config(cls, **options: Any) -> "FakeEngine":
        return cls()

    async def generate(self, prompt, params, request_id: str, priority: int = 0):
        if self.dead:
            raise EngineDeadError("engine stopped: RuntimeError('a rank died')")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequest("prompt", "prompt is empty: give at least one token of text")
        if any(not 0 <= t < VOCAB_SIZE for t in ids):
            raise InvalidRequest("prompt", "prompt token id is out of range")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest("prompt", f"prompt is {len(ids)} tokens: the context holds {self.max_model_len}")
        self.num_streams += 1
        self.num_generate += 1
        try:
            for n in range(1, params.max_tokens + 1):
                if (self.hold and n > 1) or self.hold_first:
                    await self.release.wait()
                last = n == params.max_tokens
                yield StepOutput(request_id, [120], "x", None, last, "length" if last else None, len(ids), n)
        finally:
            self.num_streams -= 1

    def check_health(self) -> None:
        if self.dead:
            raise EngineDeadError("engine stopped")

    def shutdown(self) -> None:
        pass


class FakeContext:
    """A gRPC servicer context: records the status code and details."""

    code = details = None
    trailing_metadata = ()

    def set_code(self, code) -> None:
        self.code = code

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing_metadata = tuple(metadata)

    def set_details(self, details: str) -> None:
        self.details = details

    def invocation_metadata(self):
        return ()


def make_request(prompt: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens))


def make_ingress(**fields: Any) -> tuple[IngressCore, FakeEngine]:
    config = ServeConfig(**{"metrics_port": 0, "max_num_seqs": 2, "max_queued_requests": 1, "max_request_bytes": 4096,
                            **fields})
    server = LLMServer(config, engine_cls=FakeEngine)
    return IngressCore(config.model_dump(), LocalHandle(server)), server.engine


def http_request(body: bytes | dict, leaves_after_s: float | None = None) -> Request:
    """A request whose client stays (or leaves leaves_after_s after sending its body)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent, start = False, time.monotonic()

    async def receive():
        nonlocal sent
        if sent:  # as a server's receive: the disconnect at once once it happened, else wait
            if leaves_after_s is None or time.monotonic() < start + leaves_after_s:
                await asyncio.Event().wait()
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}, receive)


async def post(ingress: IngressCore, path: str, body: bytes | dict) -> tuple[int, dict]:
    route = ingress.chat_completions if path == "chat" else ingress.completions
    response = await route(http_request(body))
    return response.status_code, json.loads(response.body)


HTTP_CASES = [  # (id, path, body, status, param)
    ("empty prompt", "completions", {"prompt": ""}, 400, "prompt"),
    ("token id out of range", "completions", {"prompt": [1, 10_000]}, 400, "prompt"),
    ("prompt over the context", "completions", {"prompt": "w" * 80}, 400, "prompt"),
    ("chat over the context", "chat", {"messages": [{"role": "user", "content": "w" * 80}]}, 400, "messages"),
    ("unknown model", "completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("temperature < 0", "completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("max_tokens = 0", "completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("top_logprobs > 20", "chat", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                   "top_logprobs": 30}, 400, "top_logprobs"),
    ("n = 0", "completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("wrong type", "completions", {"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens"),
    ("malformed JSON", "completions", b'{"prompt": "hi",', 400, "body"),
    ("oversized body", "completions", {"prompt": "x" * 5000}, 413, "body"),
]


@pytest.mark.parametrize("path,body,status,param", [c[1:] for c in HTTP_CASES], ids=[c[0] for c in HTTP_CASES])
def test_http_bad_input_names_the_field(path, body, status, param):
    ingress, _ = make_ingress()
    got_status, got = asyncio.run(post(ingress, path, body))
    assert got_status == status and got["error"]["param"] == param, got
    assert ingress.num_in_flight == 0


def test_http_error_bodies():
    ingress, _ = make_ingress()
    _, body = asyncio.run(post(ingress, "completions", {"prompt": "hi", "temperature": -1}))
    assert body == {"error": {"message": "temperature=-1.0 is invalid: must be a finite number >= 0 (0 = greedy)",
                              "type": "invalid_request_error", "param": "temperature", "code": None}}
    # the engine's "prompt" is chat's "messages", in the param and the message
    _, body = asyncio.run(post(ingress, "chat", {"messages": [{"role": "user", "content": "w" * 80}]}))
    assert body["error"]["message"].startswith("messages is ") and body["error"]["param"] == "messages"
    _, body = asyncio.run(post(ingress, "chat", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                                 "top_logprobs": 30}))
    assert body["error"]["message"] == "top_logprobs=30 is invalid: must be None or in [0, 20]"


GRPC_CASES = [  # (id, request, code, field named in the details)
    ("empty prompt", pb.GenerateRequest(text=""), "INVALID_ARGUMENT", "prompt"),
    ("prompt over the context", pb.GenerateRequest(text="w" * 80), "INVALID_ARGUMENT", "prompt"),
    ("unknown model", pb.GenerateRequest(model="gpt-9", text="hi"), "NOT_FOUND", "model"),
    ("top_p > 1", pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(top_p=1.5)), "INVALID_ARGUMENT",
     "top_p"),
    ("unknown role", pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="robot", content="x")])),
     "INVALID_ARGUMENT", "role"),
    ("not a protobuf message", b"\xff\xff\xff\xff", "INVALID_ARGUMENT", "request"),
]


@pytest.mark.parametrize("request_,code,field", [c[1:] for c in GRPC_CASES], ids=[c[0] for c in GRPC_CASES])
def test_grpc_bad_input_names_the_field(request_, code, field):
    ingress, _ = make_ingress()
    raw = request_ if isinstance(request_, bytes) else request_.SerializeToString()
    context = FakeContext()
    with pytest.raises(RequestError):
        asyncio.run(ingress.Complete(raw, context))
    assert context.code == getattr(grpc.StatusCode, code) and field in context.details


def test_admission_refuses_past_the_queue_limit():
    ingress, engine = make_ingress()  # 2 running + 1 waiting in flight
    engine.hold = True

    async def scenario():
        starts = [await ingress._start(None, make_request("hi", 2)) for _ in range(3)]
        response = await ingress.completions(http_request({"prompt": "hi"}))
        status, body = response.status_code, json.loads(response.body)
        assert response.headers["retry-after"] == "1"
        context = FakeContext()
        with pytest.raises(RequestError):
            await ingress.Complete(pb.GenerateRequest(text="hi").SerializeToString(), context)
        engine.release.set()  # the held streams finish; then a new request is admitted again
        for _, _, stream in starts:
            assert [c async for chunks in stream for c in chunks][-1].finish_reason == "length"
        status_after, _ = await post(ingress, "completions", {"prompt": "hi"})
        return status, body, context.code, status_after

    status, body, code, status_after = asyncio.run(scenario())
    assert status == 503 and body["error"]["type"] == "overloaded_error"
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_after == 200 and ingress.num_in_flight == 0
    assert refused(ingress, "requests") == 2 and refused(ingress, "tokens") == 0


def refused(ingress: IngressCore, limit: str) -> float:
    return ingress.metrics.refused.labels(model=ingress.model, limit=limit)._value.get()


def test_admission_refuses_a_prompt_past_the_replicas_queued_tokens():
    """max_queued_tokens=10: a 6-token prompt waits, a second would make 12 and is refused; one prompt longer than
    the bound is still admitted into an empty queue; the admitted request is served."""
    ingress, engine = make_ingress(max_num_seqs=4, max_queued_requests=4, max_queued_tokens=10)
    engine.hold_first = True

    async def scenario():
        waiting = asyncio.create_task(ingress._start(None, make_request("6 toks", 2)))
        await asyncio.sleep(0.01)
        response = await ingress.completions(http_request({"prompt": "6 more"}))
        context = FakeContext()
        with pytest.raises(RequestError):
            await ingress.Complete(pb.GenerateRequest(text="6 more").SerializeToString(), context)
        engine.release.set()
        _, first, stream = await waiting
        chunks = first + [c async for more in stream for c in more]
        engine.release.clear()
        engine.hold_first = False
        status_long, _ = await post(ingress, "completions", {"prompt": "w" * 30})
        return response, context, chunks, status_long

    response, context, chunks, status_long = asyncio.run(scenario())
    body = json.loads(response.body)
    assert response.status_code == 503 and response.headers["retry-after"] == "1", body
    assert body["error"]["message"] == ("6 prompt tokens wait on this replica and this request has 6: past "
                                        "max_queued_tokens=10; retry in 1 s")
    assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED and context.trailing_metadata == (("retry-after", "1"),)
    assert chunks[-1].finish_reason == "length" and sum(len(c.ids) for c in chunks) == 2
    assert status_long == 200 and refused(ingress, "tokens") == 2 and refused(ingress, "requests") == 0
    assert ingress.llm.server.num_queued_tokens == 0


def test_dead_engine_is_unavailable_and_fails_the_health_check():
    ingress, engine = make_ingress()
    engine.dead = True
    status, body = asyncio.run(post(ingress, "completions", {"prompt": "hi"}))
    assert status == 503 and body["error"]["type"] == "server_error"
    context = FakeContext()
    with pytest.raises(RequestError):
        asyncio.run(ingress.Complete(pb.GenerateRequest(text="hi").SerializeToString(), context))
    assert context.code == grpc.StatusCode.UNAVAILABLE
    server = LLMServer(ServeConfig(metrics_port=0), engine_cls=FakeEngine)
    server.engine.dead = True
    with pytest.raises(EngineDeadError):
        asyncio.run(server.check_health())


def test_a_draining_ingress_refuses_new_requests_and_lets_running_ones_finish():
    ingress, engine = make_ingress()
    engine.hold = True

    async def scenario():
        _, _, running = await ingress._start(None, make_request("hi", 3))
        in_flight = await ingress.drain()
        status, body = await post(ingress, "completions", {"prompt": "hi"})
        context = FakeContext()
        with pytest.raises(RequestError):
            await ingress.Complete(pb.GenerateRequest(text="hi").SerializeToString(), context)
        health = await ingress.health()
        engine.release.set()
        rest = [c async for chunks in running for c in chunks]
        return in_flight, status, body, context.code, health.status_code, rest, await ingress.drain()

    in_flight, status, body, code, health, rest, left = asyncio.run(scenario())
    assert in_flight == 1 and left == 0
    assert status == 503 and body["error"]["type"] == "server_error" and "shutting down" in body["error"]["message"]
    assert code == grpc.StatusCode.UNAVAILABLE and health == 503
    assert rest[-1].finish_reason == "length" and rest[-1].completion_tokens == 3


def test_health_runs_one_token_through_an_idle_engine_and_concurrent_probes_share_it():
    ingress, engine = make_ingress(health_timeout_s=0.3)

    async def probes(n: int):
        return [(r.status_code, json.loads(r.body)["message"]) for r in
                await asyncio.gather(*(ingress.health() for _ in range(n)))]

    assert asyncio.run(probes(5)) == [(200, "serving SmolLM2-135M-Instruct")] * 5 and engine.num_generate == 1
    engine.hold_first = True  # the step never ends: the probe's token never comes
    start = time.monotonic()
    stuck = asyncio.run(probes(5))
    assert time.monotonic() - start < 2 and engine.num_generate == 2 and engine.num_streams == 0  # aborted
    assert stuck == [(503, "the engine produced no token in 0.3 s (health_timeout_s): a step is stalled")] * 5
    engine.stalled_s = 0.5  # past health_timeout_s: unhealthy at once, no request sent
    (status, message), = asyncio.run(probes(1))
    assert status == 503 and "no progress for 0.5 s" in message and "stalled" in message and engine.num_generate == 2


def test_serves_health_check_fails_a_stalled_engine():
    server = LLMServer(ServeConfig(metrics_port=0, health_timeout_s=5), engine_cls=FakeEngine)
    asyncio.run(server.check_health())
    server.engine.stalled_s = 6.0
    with pytest.raises(EngineDeadError, match="no progress for 6.0 s"):
        asyncio.run(server.check_health())


@pytest.mark.parametrize("stream,hold", [(True, "hold_first"), (False, "hold_first"), (False, "hold")],
                         ids=["stream-queued", "unary-queued", "unary-running"])
def test_an_http_client_leaving_before_its_answer_aborts_its_request(stream, hold):
    """As on the Ingress's own HTTP server (direct_http), which does not cancel a handler whose client left: a
    request still queued (no first token yet), or non-streamed and running, is aborted once its client leaves."""
    ingress, engine = make_ingress()
    setattr(engine, hold, True)  # hold_first: queued, no first token comes; hold: running, after its first token

    async def scenario():
        body = {"prompt": "hi", "stream": stream, "max_tokens": 8}
        response = await ingress.completions(http_request(body, leaves_after_s=0.3))
        await asyncio.sleep(0.1)  # the replica's side of the cancellation
        return response.status_code

    start = time.monotonic()
    assert asyncio.run(scenario()) == 499 and time.monotonic() - start < 3
    assert engine.num_streams == 0 and ingress.num_in_flight == 0  # aborted in the engine, out of the admission count
    assert ingress.metrics.requests.labels(model=ingress.model, finish_reason="abort")._value.get() == 1


def test_the_health_checks_error_unpickles_without_torch():
    """A failed health check carries EngineDeadError to Serve's controller, which imports the error's module to unpickle
    it: that must not load torch (the controller grew 85 -> 211 MiB in the soak after one check failed in a pause)."""
    data = pickle.dumps(EngineDeadError("stalled"))
    code = f"import pickle, sys; e = pickle.loads({data!r}); assert 'torch' not in sys.modules; print(type(e).__name__)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "EngineDeadError", run.stderr
