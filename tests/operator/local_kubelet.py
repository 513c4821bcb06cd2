"""A kubelet stand-in that runs the operator's pods as local processes, so the commands, env and ports the
operator generates are what actually starts.

For each pod in the API server it starts the container's command + args with the pod's env (secretKeyRef read
from the API server, fieldRef metadata.name), every Service and pod DNS name resolved to 127.0.0.1, and each
pod's Ray ports (and a rank pod's every declared port, in its flags and its *_PORT env) mapped to free host ports
(all pods share 127.0.0.1, as they would not share an IP). It marks
the pod Running, runs its readiness probe and reports Ready, and stops the process when the pod is deleted.
No images, volumes, cgroups or init containers: the embedded model is in this venv.
"""
from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from control_plane import free_port, private_ray_tmpdir, stop_process
from cpuserve.operator.kube import Kube
from cpuserve.operator.naming import LABEL_SERVICE

RAY_PORTS = (6379, 8265, 52365)  # GCS, dashboard, dashboard agent: fixed in the pods, remapped here
_HOST_PORT = re.compile(r"\b([a-z0-9][-a-z0-9.]*):(\d+)\b")
_PORT_FLAG = re.compile(r"^(--[a-z-]*port)=(\d+)$")


class LocalKubelet(threading.Thread):
    def __init__(self, kube: Kube, namespace: str, service: str, log_dir: Path):
        super().__init__(daemon=True)
        self.kube, self.ns, self.service, self.log_dir = kube, namespace, service, log_dir
        self.head_ports = {p: free_port() for p in RAY_PORTS}  # known before the head starts (the operator's URL)
        self.procs: dict[str, tuple[subprocess.Popen, dict[int, int], Any]] = {}  # pod -> (process, ports, log)
        self.ready: set[str] = set()
        self.exited: dict[str, int] = {}
        self.errors: list[str] = []
        self._halt = threading.Event()
        self.tmp = private_ray_tmpdir()

    # ---- what a container sees ----
    def _env(self, pod: dict[str, Any], container: dict[str, Any], ports: dict[int, int]) -> dict[str, str]:
        env = {"PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", "LANG": "C.UTF-8",
               # the node's, not the pod's: a test's Ray stops at once instead of draining for 30 s, and keeps its
               # files (and its address file) out of the machine's shared /tmp/ray
               "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "RAY_TMPDIR": self.tmp}
        for item in container.get("env") or []:
            source = item.get("valueFrom") or {}
            if "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                secret = self.kube.get("Secret", self.ns, ref["name"]) or {}
                env[item["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
            elif "fieldRef" in source:
                assert source["fieldRef"]["fieldPath"] == "metadata.name", source
                env[item["name"]] = pod["metadata"]["name"]
            elif item["name"].endswith("_PORT") and item["value"].isdigit():  # a port the pod declares: mapped
                env[item["name"]] = str(ports.get(int(item["value"]), int(item["value"])))
            else:
                env[item["name"]] = item["value"]
        return env

    def _localize(self, args: list[str], ports: dict[int, int], names: list[str]) -> list[str]:
        """DNS names -> 127.0.0.1 (host:port of another pod -> the head's mapped port); own port flags mapped."""
        out = []
        for arg in args:
            def to_local(m: re.Match) -> str:
                host, port = m.group(1), int(m.group(2))
                if host.split(".")[0] not in names:
                    return m.group(0)
                return f"127.0.0.1:{self.head_ports.get(port, port)}"
            arg = _HOST_PORT.sub(to_local, arg)
            if (m := _PORT_FLAG.match(arg)) and int(m.group(2)) in ports:
                arg = f"{m.group(1)}={ports[int(m.group(2))]}"
            out.append(arg)
        return out

    def _start(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        (container,) = pod["spec"]["containers"]
        if name.endswith("-head"):  # its serving ports are the Serve app's (the test picks free ones)
            ports = self.head_ports
        else:  # Ray's and every other port the rank pod declares (its engine's metrics)
            declared = {p["containerPort"] for p in container.get("ports") or []}
            ports = {p: free_port() for p in sorted(declared | set(RAY_PORTS))}
        names = [s["metadata"]["name"] for s in self.kube.list("Service", self.ns, f"{LABEL_SERVICE}={self.service}")]
        names += [p["metadata"]["name"] for p in self.kube.list("Pod", self.ns, f"{LABEL_SERVICE}={self.service}")]
        cmd = self._localize(container["command"] + container.get("args", []), ports, names)
        log = open(self.log_dir / f"{name}.log", "w")
        proc = subprocess.Popen(cmd, env=self._env(pod, container, ports), stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = (proc, ports, log)
        self.kube.merge_patch("Pod", self.ns, name, {"status": {"phase": "Running", "conditions": [
            {"type": "Ready", "status": "False"}]}}, sub="status")

    def _probe(self, name: str, pod: dict[str, Any]) -> bool:
        (container,) = pod["spec"]["containers"]
        get = (container.get("readinessProbe") or {}).get("httpGet")
        named = {p["name"]: p["containerPort"] for p in container.get("ports") or []}
        port = named.get(get["port"], get["port"])
        port = self.procs[name][1].get(port, port)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{get['path']}", timeout=3) as rsp:
                return rsp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    # ---- the loop ----
    def step(self) -> None:
        pods = {p["metadata"]["name"]: p for p in self.kube.list("Pod", self.ns, f"{LABEL_SERVICE}={self.service}")}
        for name in [n for n in self.procs if n not in pods]:  # deleted
            self._kill(name)
        for name, pod in pods.items():
            if name not in self.procs:
                self._start(pod)
                continue
            proc = self.procs[name][0]
            if proc.poll() is not None and name not in self.exited:
                self.exited[name] = proc.returncode
                self.kube.merge_patch("Pod", self.ns, name, {"status": {"phase": "Failed"}}, sub="status")
            elif name not in self.ready and self._probe(name, pod):
                self.ready.add(name)
                self.kube.merge_patch("Pod", self.ns, name, {"status": {"phase": "Running", "conditions": [
                    {"type": "Ready", "status": "True"}]}}, sub="status")

    def run(self) -> None:
        while not self._halt.wait(0.5):
            try:
                self.step()
            except Exception as err:  # an API hiccup: the next step tries again (a real kubelet does too)
                self.errors.append(repr(err))

    def _kill(self, name: str) -> None:
        proc, _, log = self.procs.pop(name)
        stop_process(proc, 60)
        log.close()
        self.ready.discard(name)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)
        for name in sorted(self.procs, key=lambda n: n.endswith("-head")):  # ranks first, the head last
            self._kill(name)
        time.sleep(1)
        shutil.rmtree(self.tmp, ignore_errors=True)
