"""`cpuserve serve` as a process: how it drains on SIGTERM (new requests refused, running ones finish, exit 0) and
what it leaves behind when it stops."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import psutil
import pytest

from cli_checks import CPUSERVE, free_port
from cpuserve.serving.app import registrations_since, remove_openmp_registrations


def test_openmp_registrations_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    uid = os.getuid()
    files = {name: tmp_path / f"__KMP_REGISTERED_LIB_{pid}_{u}"
             for name, pid, u in (("dead", dead.pid, uid), ("alive", os.getpid(), uid), ("other", dead.pid, uid + 1))}
    for path in files.values():
        path.write_text("registration")
    assert remove_openmp_registrations({dead.pid, os.getpid()}, shm=tmp_path) == [files["dead"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files[k].name for k in ("alive", "other"))


def test_registrations_written_while_serving_are_found_by_time(tmp_path):
    uid = os.getuid()
    old, new, other = (tmp_path / f"__KMP_REGISTERED_LIB_{pid}_{u}" for pid, u in ((11, uid), (12, uid), (13, uid + 1)))
    for path in (old, new, other):
        path.write_text("registration")
    start = time.time() - 5
    os.utime(old, (start - 60, start - 60))  # before serving started: another program's, kept
    assert registrations_since(start, shm=tmp_path) == {12}


# Ports Ray 2.60 opens on every interface whatever the node address (measured: `cpuserve serve` on 127.0.0.1):
# its core gRPC servers (GCS, raylet, every worker), Serve's gRPC proxy and replica data plane ("[::]" is hard-coded
# in ray/serve/_private/grpc_util.py and replica.py), and the dashboard/runtime-env agents' HTTP servers, which take
# the host's address. docs/serving.md lists them; the HTTP and metrics endpoints follow --host.
WIDE = {"::", "0.0.0.0"}
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}  # the last: grpc's dual-stack socket bound to 127.0.0.1


def test_only_the_normal_shutdown_line_is_dropped_from_forwarded_logs():
    from cpuserve.serving.app import _forward_unless_normal_shutdown

    got = []
    normal = [f"Task ServeController.{call} failed. There are infinite retries remaining, so the task will be "
              "retried. Error: The actor is dead because it was killed by `ray.kill`."
              for call in ("graceful_shutdown", "listen_for_change")]
    other = "Task LLMServer.generate failed. Error: The actor is dead because it was killed by `ray.kill`."
    _forward_unless_normal_shutdown(got.append, {"pid": "raylet", "lines": [*normal, other]})
    _forward_unless_normal_shutdown(got.append, {"pid": "raylet", "lines": normal})
    assert [d["lines"] for d in got] == [[other]]


def _command(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:  # ended meanwhile
        return ""


def listening(pids: list[int]) -> dict[tuple[str, int], str]:
    out = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for c in proc.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out[(c.laddr.ip, c.laddr.port)] = proc.name()
        except psutil.Error:
            pass
    return out


@pytest.mark.parametrize("to_group", [True, False], ids=["kill-group", "kill-main"])
def test_serve_binds_its_endpoints_to_host_and_sigterm_stops_every_process(tmp_path, to_group):
    proc, ports, err = start_serve(tmp_path)
    try:
        tree = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        commands = " ".join(_command(pid) for pid in tree)
        for unused in ("autoscaler/_private/monitor.py", "_private/log_monitor.py", "dashboard/dashboard.py"):
            assert unused not in commands  # serving/ray_env.py head_without_extras
        assert "ServeController" in commands and "raylet" in commands
        sockets = listening(tree)
        assert sockets[("127.0.0.1", ports["http"])] and sockets[("127.0.0.1", ports["metrics"])]
        assert any(sockets.get((ip, ports["grpc"])) for ip in LOOPBACK)  # direct_grpc: on host, not all interfaces
        host_ips = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs} - LOOPBACK
        unexpected = {k: v for k, v in sockets.items() if k[0] not in LOOPBACK | WIDE | host_ips}
        assert unexpected == {}
        assert not any("ProxyActor" in name for name in sockets.values())  # direct ports: Serve starts no proxy
        running = Stream(ports["http"]) if to_group else None  # in flight when SIGTERM comes
        os.killpg(proc.pid, signal.SIGTERM) if to_group else proc.send_signal(signal.SIGTERM)
        if running is not None:
            refused = refused_while_draining(ports)
            running.join(timeout=90)
            assert running.result == ("length", Stream.MAX_TOKENS), running.result  # it ran to its end
            assert refused["http"] == (503, "server_error") and refused["grpc"] == grpc.StatusCode.UNAVAILABLE, refused
            assert refused["health"] == 503
        assert proc.wait(timeout=90) == 0, _read(err)
        gone, alive = psutil.wait_procs([psutil.Process(p) for p in tree if psutil.pid_exists(p)], timeout=15)
        assert alive == [], [p.info if hasattr(p, "info") else p for p in alive]
        log = _read(err)
        assert "Traceback" not in log and "SIGTERM received" not in log, log
        assert "Connecting to existing Serve app" not in log, log
        assert " is ready at http" not in log, log  # Serve's line names its proxy's URL, not the endpoints
        assert " failed" not in log, log  # graceful_shutdown, listen_for_change: normal at every shutdown, filtered
        leftover = [p for p in tree if not psutil.pid_exists(p)  # a pid reused since is another process's
                    and (Path("/dev/shm") / f"__KMP_REGISTERED_LIB_{p}_{os.getuid()}").exists()]
        assert leftover == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


class Stream(threading.Thread):
    """A long streamed completion read to its end in a thread; `result` = (finish_reason, completion tokens)."""

    MAX_TOKENS = 600

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port, self.result, self.started = port, None, threading.Event()
        self.start()
        assert self.started.wait(60), "the stream did not start"

    def run(self) -> None:
        body = {"prompt": "Count:", "max_tokens": self.MAX_TOKENS, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        reason = None
        with httpx.stream("POST", f"http://127.0.0.1:{self.port}/v1/completions", json=body, timeout=120) as rsp:
            for line in rsp.iter_lines():
                self.started.set()
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:
                        reason = chunk["choices"][0]["finish_reason"] or reason
                    else:
                        self.result = (reason, chunk["usage"]["completion_tokens"])


def refused_while_draining(ports: dict[str, int]) -> dict:
    """Once /health says 503 (draining), what a new request gets over HTTP and gRPC."""
    from cpuserve.v1 import inference_pb2 as pb
    from cpuserve.v1 import inference_pb2_grpc as pbg

    deadline = time.monotonic() + 30
    while (health := httpx.get(f"http://127.0.0.1:{ports['http']}/health", timeout=10)).status_code == 200:
        assert time.monotonic() < deadline, "still healthy 30 s after SIGTERM"
        time.sleep(0.2)
    rsp = httpx.post(f"http://127.0.0.1:{ports['http']}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                     timeout=30)
    with grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}") as channel:
        try:
            pbg.InferenceStub(channel).Complete(pb.GenerateRequest(text="Hi"), timeout=30)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
    return {"health": health.status_code, "http": (rsp.status_code, rsp.json()["error"]["type"]), "grpc": code}


def start_serve(tmp_path: Path, ray_auth: dict[str, str] | None = None,
                wait: str | None = None) -> tuple[subprocess.Popen, dict[str, int], Any]:
    """`cpuserve serve` in a session of its own on free ports, once /health answers 200 (or once its stderr has the
    line `wait`): (process, ports, stderr). ray_auth: Ray's token auth variables (default: auth off)."""
    ports = {"grpc": free_port(), "http": free_port(), "metrics": free_port()}
    err = (tmp_path / "stderr").open("w+")
    proc = subprocess.Popen([CPUSERVE, "serve", "--grpc-port", str(ports["grpc"]), "--http-port", str(ports["http"]),
                             "--metrics-port", str(ports["metrics"]), "--kv-cache-gb", "0.25"],
                            stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                            env={**os.environ, **(ray_auth or {"RAY_AUTH_MODE": "disabled"})})
    deadline = time.monotonic() + 180
    while not (wait in _read(err) if wait else _healthy(ports["http"])):
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
            pytest.fail(f"cpuserve serve did not become healthy: {_read(err)}")
        time.sleep(0.05 if wait else 1)
    return proc, ports, err


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _read(f) -> str:
    f.flush()
    f.seek(0)
    return f.read()[-4000:]


@pytest.mark.parametrize("when", ["starting", "serving"])
def test_a_burst_of_signals_still_stops_the_serving_process(tmp_path, when):
    """`pkill cpuserve` signals the supervisor and the serving process at once, and the supervisor passes its signal
    on: a second signal may then arrive while the first one's handler runs, while Serve starts the app or while it
    serves. The process still stops, in order (a handler that set a threading.Event deadlocked on the Event's lock
    when a second signal interrupted it)."""
    proc, ports, err = start_serve(tmp_path, wait="serving; Ctrl-C stops" if when == "serving" else "Started Serve")
    serving = psutil.Process(proc.pid).children()[0]
    try:
        # while Ray starts, its SIGTERM handler is the driver's (a stack dump, then death): SIGINT only until serving
        burst = [signal.SIGINT] if when == "starting" else [signal.SIGINT, signal.SIGTERM]
        end = time.monotonic() + 2
        with contextlib.suppress(ProcessLookupError):  # it may stop before the burst ends
            while time.monotonic() < end:
                for sig in burst:
                    os.kill(serving.pid, sig)
        assert proc.wait(timeout=120) == 0, _read(err)
        assert "shutting down" in _read(err)
    finally:
        for group in (proc.pid, serving.pid):  # the serving process leads a session of its own: Ray's processes too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)


def test_sigkill_of_the_serving_process_leaves_no_process_behind(tmp_path):
    """`cpuserve serve` runs the serving process under a supervisor: killing the serving process outright (OOM
    killer, kill -9) leaves none of Ray's processes behind (its agents lingered about a minute before)."""
    proc, ports, err = start_serve(tmp_path)
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
        serving = psutil.Process(proc.pid).children()[0]
        assert any(p.name() == "raylet" for p in tree) and any("Ingress" in p.name() for p in tree)
        serving.kill()
        assert proc.wait(timeout=30) == 128 + signal.SIGKILL
        gone, alive = psutil.wait_procs(tree, timeout=10)
        assert alive == [], [(p.pid, p.name()) for p in alive]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def gcs_address(proc: subprocess.Popen) -> str:
    """The address of the Ray cluster `cpuserve serve` started (its raylet's --gcs-address): other runs on this machine
    have clusters of their own, so `auto` could find theirs."""
    for p in psutil.Process(proc.pid).children(recursive=True):
        for arg in p.cmdline() if p.name() == "raylet" else ():
            if arg.startswith("--gcs-address="):
                return arg.split("=", 1)[1]
    raise AssertionError("no raylet under cpuserve serve")


def pods_prestop(drain_timeout_s: int, token: str) -> dict[str, tuple[list[str], dict[str, str]]]:
    """The preStop command of the head pod and of a rank pod as the operator renders them for an LLMService of
    drainTimeoutSeconds=drain_timeout_s, each with its container's environment as a kubelet gives it: its secret
    reference read from the Ray token Secret the operator makes (holding `token`), its field reference resolved,
    PATH as the image sets it (cpuserve first)."""
    from cpuserve.operator.children import build_children
    from cpuserve.operator.security import build_ray_token_secret
    from cpuserve.operator.settings import OperatorSettings
    from cpuserve.operator.validation import validate

    body = {"apiVersion": "cpuserve.dev/v1alpha1", "kind": "LLMService",
            "metadata": {"name": "chat", "namespace": "default", "uid": "uid-1", "generation": 1},
            "spec": {"model": {"source": "embedded"}, "replicas": 1, "drainTimeoutSeconds": drain_timeout_s}}
    settings = OperatorSettings()
    spec, findings = validate(body, settings)
    assert findings == []
    secret = build_ray_token_secret("chat", token)
    out = {}
    for pod in (m for m in build_children(body, spec, settings, False) if m["kind"] == "Pod"):
        (container,) = pod["spec"]["containers"]
        env = {"PATH": f"{Path(CPUSERVE).parent}:{os.environ['PATH']}"}
        for item in container["env"]:
            ref = item.get("valueFrom", {})
            if "secretKeyRef" in ref:
                assert ref["secretKeyRef"]["name"] == secret["metadata"]["name"], ref
                env[item["name"]] = base64.b64decode(secret["data"][ref["secretKeyRef"]["key"]]).decode()
            elif "fieldRef" in ref:
                assert ref["fieldRef"]["fieldPath"] == "metadata.name", ref
                env[item["name"]] = pod["metadata"]["name"]
            else:
                env[item["name"]] = item["value"]
        role = "head" if pod["metadata"]["name"].endswith("-head") else "rank"
        out[role] = (container["lifecycle"]["preStop"]["exec"]["command"], env)
    assert set(out) == {"head", "rank"}
    return out


def test_the_pods_prestop_drains_a_running_cpuserve_serve(tmp_path):
    """The commands the operator puts in the pods' preStop, run as a kubelet runs them (the command as rendered, the
    container's environment) against a running `cpuserve serve` with Ray token auth on, as in the pods: the rank pod's
    returns once the running stream ends and refuses nothing; the head pod's refuses new requests while the running
    one runs to its end, and returns after. The one stand-in: RAY_ADDRESS names this serve's cluster (in a pod, `auto`
    finds the pod's only cluster; other test runs have clusters on this machine)."""
    token = secrets.token_urlsafe(32)
    prestop = pods_prestop(60, token)
    proc, ports, err = start_serve(tmp_path, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})

    def run(role: str) -> subprocess.CompletedProcess:
        command, env = prestop[role]
        return subprocess.run(command, env={**env, "RAY_ADDRESS": gcs_address(proc)}, capture_output=True,
                              text=True, timeout=120)

    try:
        running = Stream(ports["http"])
        waited = run("rank")
        assert waited.returncode == 0 and "drain: no request runs" in waited.stderr, waited.stderr
        running.join(timeout=30)
        assert running.result == ("length", Stream.MAX_TOKENS), running.result
        assert _healthy(ports["http"])  # nothing refused
        running = Stream(ports["http"])
        draining = threading.Thread(target=lambda: setattr(draining, "result", run("head")), daemon=True)
        draining.start()
        refused = refused_while_draining(ports)
        draining.join(timeout=120)
        assert draining.result.returncode == 0 and "drain: no request runs" in draining.result.stderr, \
            draining.result.stderr
        assert not running.is_alive() and running.result == ("length", Stream.MAX_TOKENS), running.result
        assert refused["http"] == (503, "server_error") and refused["grpc"] == grpc.StatusCode.UNAVAILABLE, refused
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, _read(err)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
