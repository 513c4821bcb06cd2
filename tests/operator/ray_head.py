"""A real Ray head on 127.0.0.1 as the operator's head pod runs it (`ray start --head --block`, token auth on,
the pods' Ray environment), on free ports so other Ray clusters on the machine are left alone."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from control_plane import free_port, private_ray_tmpdir, stop_process, wait_for
from cpuserve.operator.naming import SOCKET_RESOURCE
from cpuserve.serving.ray_env import RAY_ENV

RAY = Path(sys.executable).with_name("ray")


class RayHead:
    """One `ray start --head --block` process; stop() ends it (and Ray ends what it started)."""

    def __init__(self, log: Path, num_cpus: int = 4, sockets: int = 2):
        self.token = secrets.token_hex(16)
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        self.tmp = private_ray_tmpdir()
        self.env = {**os.environ, **RAY_ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
                    "RAY_TMPDIR": self.tmp,
                    "RAY_SERVE_ENABLE_ACCESS_LOG": "0",
                    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}  # a test head stops at once (a pod drains 30 s)
        cmd = [str(RAY), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={self.gcs_port}",
               f"--num-cpus={num_cpus}", f"--resources={json.dumps({SOCKET_RESOURCE: sockets})}",
               "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
               f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}",
               f"--metrics-export-port={free_port()}", "--disable-usage-stats", "--block"]
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def wait_ready(self, timeout: float = 120) -> None:
        def up() -> bool:
            assert self.proc.poll() is None, f"ray start exited: {Path(self.log.name).read_text()[-3000:]}"
            try:
                urllib.request.urlopen(f"{self.dashboard}/api/gcs_healthz", timeout=5)
                return True
            except (urllib.error.URLError, OSError):
                return False
        wait_for("the Ray head's dashboard", up, timeout=timeout, interval=0.5)

    def stop(self) -> None:
        stop_process(self.proc, 90)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        time.sleep(1)
