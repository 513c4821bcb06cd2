"""API servers the operator tests run against: the fake (always) and, opt-in, a real control plane.

The real one follows controller-runtime's envtest convention: KUBEBUILDER_ASSETS names a folder holding etcd,
kube-apiserver and kubectl (`setup-envtest use -p path` prints one for a user with internet). As in envtest
there is no controller manager: no garbage collector, and no "default" ServiceAccount appears by itself.
Unlike envtest, the ServiceAccount admission plugin stays on (the refusal the operator must report).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, config

from cpuserve.engine.settings import OPERATOR_PREFIX, TEST_SHOW_LOG
from cpuserve.operator.kube import Kube, KubeError
from cpuserve.serving.ports import free_port
from fake_apiserver import FakeApiServer, chart_crds

ASSETS_ENV = "KUBEBUILDER_ASSETS"
ASSETS = ("etcd", "kube-apiserver", "kubectl")
TOKEN = "cpuserve-test-token"


def wait_for(what: str, predicate, timeout: float = 30.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def stop_process(proc: subprocess.Popen, timeout: float = 15) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds (`ray start --block` stops what it started on SIGTERM)."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def private_ray_tmpdir() -> str:
    """A Ray temp dir of a test's own (RAY_TMPDIR), short enough for Ray's Unix sockets. A head started in the
    shared /tmp/ray would leave /tmp/ray/ray_current_cluster behind, and every later `ray.init()` on the machine
    would try to join that cluster."""
    return tempfile.mkdtemp(prefix="cpk8s-", dir="/tmp")


def assets_missing() -> str | None:
    """Why the real control plane cannot run here, or None when it can."""
    folder = os.environ.get(ASSETS_ENV)
    if not folder:
        return (f"{ASSETS_ENV} is not set: it names a folder with {', '.join(ASSETS)} (envtest's convention; "
                "`setup-envtest use -p path` downloads them); this machine has no Kubernetes binaries")
    missing = [a for a in ASSETS if not os.access(Path(folder) / a, os.X_OK)]
    return f"{ASSETS_ENV}={folder} lacks {', '.join(missing)}" if missing else None


@dataclass
class ApiServer:
    """One running API server: its URL, a kubeconfig for it and the operator's own client on it."""

    name: str
    url: str
    kubeconfig: Path
    kube: Kube
    fake: FakeApiServer | None = None

    def create_namespace(self, ns: str, with_default_service_account: bool = True) -> None:
        """A namespace, and (as the controller manager would) its "default" ServiceAccount."""
        try:
            self.kube._call("POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace",
                                                               "metadata": {"name": ns}})
        except KubeError as err:
            if err.status != 409:
                raise
        if with_default_service_account:
            self.create_service_account(ns, "default")

    def create_service_account(self, ns: str, name: str) -> None:
        self.kube.create({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": ns}})


def write_kubeconfig(path: Path, url: str, namespace: str = "default") -> Path:
    insecure = ", insecure-skip-tls-verify: true" if url.startswith("https") else ""
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: test\n"
        f"clusters: [{{name: test, cluster: {{server: '{url}'{insecure}}}}}]\n"
        f"users: [{{name: test, user: {{token: {TOKEN}}}}}]\n"
        f"contexts: [{{name: test, context: {{cluster: test, user: test, namespace: {namespace}}}}}]\n")
    return path


def kube_for(kubeconfig: Path) -> Kube:
    cfg = client.Configuration()
    config.load_kube_config(str(kubeconfig), client_configuration=cfg)
    return Kube(client.ApiClient(cfg))


def start_fake(tmp: Path) -> ApiServer:
    api = FakeApiServer().start()
    url = f"http://127.0.0.1:{api.port}"
    kubeconfig = write_kubeconfig(tmp / "kubeconfig", url)
    return ApiServer("fake", url, kubeconfig, kube_for(kubeconfig), api)


def _service_account_key(path: Path) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                       serialization.NoEncryption()))
    return path


class RealControlPlane:
    """etcd + kube-apiserver from KUBEBUILDER_ASSETS on 127.0.0.1, the chart's CRDs installed."""

    def __init__(self) -> None:
        self.assets = Path(os.environ[ASSETS_ENV])
        self.tmp = Path(tempfile.mkdtemp(prefix="cpuserve-envtest-"))
        self.procs: list[subprocess.Popen] = []

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.tmp / f"{name}.log", "w")
        self.procs.append(subprocess.Popen([str(self.assets / name), *args], stdout=log, stderr=subprocess.STDOUT))

    def start(self) -> ApiServer:
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        self._spawn("etcd", [f"--data-dir={self.tmp / 'etcd'}", f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                             f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                             f"--listen-peer-urls=http://127.0.0.1:{peer_port}", "--unsafe-no-fsync"])
        (self.tmp / "tokens.csv").write_text(f'{TOKEN},cpuserve-test,1,"system:masters"\n')
        key = _service_account_key(self.tmp / "sa.key")
        self._spawn("kube-apiserver", [
            f"--etcd-servers=http://127.0.0.1:{etcd_port}", f"--cert-dir={self.tmp / 'certs'}",
            "--bind-address=127.0.0.1", f"--secure-port={api_port}", "--service-cluster-ip-range=10.0.0.0/24",
            f"--token-auth-file={self.tmp / 'tokens.csv'}", "--authorization-mode=RBAC",
            f"--service-account-key-file={key}", f"--service-account-signing-key-file={key}",
            "--service-account-issuer=https://kubernetes.default.svc"])
        url = f"https://127.0.0.1:{api_port}"
        kubeconfig = write_kubeconfig(self.tmp / "kubeconfig", url)
        kube = kube_for(kubeconfig)
        wait_for("kube-apiserver /readyz", lambda: self._ready(kube), timeout=90, interval=0.5)
        for crd in chart_crds():
            kube._call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", body=crd)
            path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}"
            wait_for("the CRD to be established", lambda: any(
                c["type"] == "Established" and c["status"] == "True"
                for c in (kube._call("GET", path).get("status") or {}).get("conditions") or []), timeout=30)
        return ApiServer("real", url, kubeconfig, kube)

    def _ready(self, kube: Kube) -> bool:
        if any(p.poll() is not None for p in self.procs):
            logs = {p.name: p.read_text()[-2000:] for p in self.tmp.glob("*.log")}
            raise RuntimeError(f"the control plane exited: {logs}")
        try:  # the bootstrap controller creates the "default" namespace once the server serves
            return kube._call("GET", "/api/v1/namespaces/default").get("metadata", {}).get("name") == "default"
        except (KubeError, urllib.request.URLError, OSError, ValueError):
            return False

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop_process(proc)
        shutil.rmtree(self.tmp, ignore_errors=True)


def kubectl(server: ApiServer, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run the assets' kubectl against `server` (real control plane only)."""
    exe = Path(os.environ[ASSETS_ENV]) / "kubectl"
    return subprocess.run([str(exe), f"--kubeconfig={server.kubeconfig}", *args], input=stdin,
                          capture_output=True, text=True, timeout=60)



class OperatorProcess:
    """The real operator (`python -m cpuserve.operator`) on a kubeconfig; `settings` become CPUSERVE_OPERATOR_*."""

    def __init__(self, kubeconfig: Path, namespaces: list[str], log: Path, liveness_port: int,
                 python: str = sys.executable, cwd: Path | None = None, **settings: Any):
        """python: the interpreter of the environment to run it from (cwd: its working folder)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", OPERATOR_PREFIX))}
        env.update(KUBECONFIG=str(kubeconfig), **{f"{OPERATOR_PREFIX}{k.upper()}": str(v) for k, v in settings.items()})
        self.log = open(log, "w")
        args = [f"--namespace={ns}" for ns in namespaces]
        self.proc = subprocess.Popen([python, "-m", "cpuserve.operator", "--standalone", *args,
                                      f"--liveness=http://127.0.0.1:{liveness_port}/healthz"],
                                     env=env, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT)

    def stop(self, show_log: bool = False) -> None:
        stop_process(self.proc)
        self.log.close()
        if show_log or TEST_SHOW_LOG.get():
            print(Path(self.log.name).read_text()[-5000:])
