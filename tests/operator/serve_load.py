"""gRPC load that runs across a change of a live Serve app, and what the head says meanwhile: streams that
record when they started and ended, a probe answered (or not) every 0.2 s, the replicas of both applications."""
from __future__ import annotations

import threading
import time

import grpc

from control_plane import wait_for
from cpuserve.operator.serve_api import ServeApi
from cpuserve.serving.names import APP_NAME, ENGINE_APP_NAME
from cpuserve.v1 import inference_pb2 as pb
from cpuserve.v1 import inference_pb2_grpc as pbg


def replicas(api: ServeApi) -> dict[str, list[tuple[str, str]]]:
    """Deployment -> [(replica id, state)] as the head reports them (both applications)."""
    return {name: [(r["replica_id"], r["state"]) for r in d.get("replicas", [])]
            for app in api.details()["applications"].values() for name, d in (app.get("deployments") or {}).items()}


def running(api: ServeApi, num: int):
    """The LLMServer replica ids once exactly `num` run and both applications are RUNNING, else None."""
    apps = api.details()["applications"]
    reps = replicas(api).get("LLMServer", [])
    ok = all((apps.get(n) or {}).get("status") == "RUNNING" for n in (APP_NAME, ENGINE_APP_NAME)) and \
        len(reps) == num and all(s == "RUNNING" for _, s in reps)
    return ok and [r for r, _ in reps]


class Stream(threading.Thread):
    """One gRPC Generate stream, greedy, `num_tokens` tokens; records when it started and finished."""

    def __init__(self, port: int, i: int, num_tokens: int):
        super().__init__(daemon=True)
        self.port, self.i, self.num_tokens = port, i, num_tokens
        self.tokens, self.first_at, self.done_at, self.finish, self.error = 0, None, None, None, None

    def run(self) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = pbg.InferenceStub(channel)
            req = pb.GenerateRequest(text=f"Story {self.i}: once upon a time",
                                     sampling=pb.SamplingParameters(max_tokens=self.num_tokens, temperature=0,
                                                                    ignore_eos=True))
            try:
                for rsp in stub.Generate(req, timeout=600):
                    self.tokens += len(rsp.token_ids)
                    self.first_at = self.first_at or time.monotonic()
                    self.finish = rsp.finish_reason or self.finish
            except grpc.RpcError as err:
                self.error = f"{err.code()}: {err.details()}"
        self.done_at = time.monotonic()

    @property
    def completed(self) -> bool:
        return self.error is None and self.tokens == self.num_tokens and self.finish == pb.FINISH_REASON_LENGTH


def start_streams(port: int, first: int, num: int, num_tokens: int) -> list[Stream]:
    """`num` streams, once each has its first token."""
    streams = [Stream(port, first + i, num_tokens) for i in range(num)]
    for s in streams:
        s.start()
    wait_for("every stream's first token", lambda: all(s.first_at or s.done_at for s in streams), timeout=300)
    return streams


class Probe(threading.Thread):
    """A short Complete every 0.2 s, naming no model, until stopped: its failures and its longest wait."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port, self.halt = port, threading.Event()
        self.ok, self.failures, self.longest = 0, [], 0.0

    def run(self) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = pbg.InferenceStub(channel)
            while not self.halt.wait(0.2):
                start = time.monotonic()
                try:
                    stub.Complete(pb.GenerateRequest(text="Hi", sampling=pb.SamplingParameters(max_tokens=2)),
                                  timeout=120)
                    self.ok += 1
                except grpc.RpcError as err:
                    self.failures.append(f"{err.code()}: {err.details()}")
                self.longest = max(self.longest, time.monotonic() - start)

    def stop(self) -> None:
        self.halt.set()
        self.join(150)


def watch_change(api: ServeApi, done, timeout: float = 420) -> list[dict[str, list[tuple[str, str]]]]:
    """What the head reports every 0.5 s until done() (an old replica replaced by a new one, say)."""
    seen, start = [], time.monotonic()
    while not done():
        seen.append(replicas(api))
        assert time.monotonic() - start < timeout, seen[-1]
        time.sleep(0.5)
    return seen


def assert_served_throughout(seen: list[dict[str, list[tuple[str, str]]]], ingress: str) -> None:
    """The ingress was never replaced; an LLMServer replica was running whenever the head listed them (while Serve
    builds a new version of the engine's application it lists none, the old replica still serving); and once the
    old and the new replica ran side by side (a surge)."""
    for state in seen:
        assert [r for r, _ in state["Ingress"]] == [ingress], state
        assert "LLMServer" not in state or any(s == "RUNNING" for _, s in state["LLMServer"]), state
    assert any(len(state.get("LLMServer", ())) >= 2 for state in seen), "the old and the new replica side by side"


def change_under_load(api: ServeApi, port: int, change, num_streams: int, num_tokens: int, what: str) -> None:
    """Run change() on a one-replica app while `num_streams` gRPC streams run and a probe asks every 0.2 s, until
    another replica alone runs; then every stream has completed across the change, every probe was answered, and
    the head's reports meanwhile pass assert_served_throughout."""
    (old,) = running(api, 1)
    (ingress,) = [r for r, _ in replicas(api)["Ingress"]]
    probe = Probe(port)
    probe.start()
    streams = start_streams(port, 100, num_streams, num_tokens)
    changed_at = time.monotonic()
    change()
    seen = watch_change(api, lambda: (now := running(api, 1)) and now != [old])
    for s in streams:
        s.join(600)
    probe.stop()
    assert all(s.completed for s in streams), [vars(s) for s in streams]
    assert all(s.done_at > changed_at for s in streams), "the streams ran across the change"
    assert probe.failures == [] and probe.ok > 0, probe.failures
    print(f"{what}: {len(seen)} polls, the longest probe took {probe.longest:.2f} s")
    assert_served_throughout(seen, ingress)
