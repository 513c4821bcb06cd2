"""free_port(): a port for a server that binds it later, picked where no other process takes ports on its own.

A port the kernel hands out for bind(("", 0)) comes from its ephemeral range (32768-60999 by default), the range
every process that asks for any port draws from: Ray's GCS, raylet, workers and agents each open several right
after `ray.init`, so a port picked there before Ray starts can be taken by the time the Ingress binds it (seen in a
bench run: the metrics port). Ray's workers otherwise use 10002-19999. So the pick is a random free port between
the two.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

RAY_WORKER_PORTS_END = 20000  # Ray's default max_worker_port is 19999
_handed_out: set[int] = set()  # ports this process picked: free until their servers bind them, so never twice


def _ephemeral_start(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port nothing on `host` listens on now and not handed out before by this process, outside the kernel's
    ephemeral range and Ray's worker ports."""
    end = _ephemeral_start()
    if end - RAY_WORKER_PORTS_END < 1000:  # a machine whose ephemeral range starts low: the kernel's pick
        return _bound_port(host, 0)
    for _ in range(tries):
        port = random.randrange(RAY_WORKER_PORTS_END, end)
        if port in _handed_out:  # picked before and maybe not bound yet (a config's three ports, picked in a row)
            continue
        try:
            _handed_out.add(_bound_port(host, port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no free port on {host} in {RAY_WORKER_PORTS_END}-{end - 1} after {tries} tries")


def _bound_port(host: str, port: int) -> int:
    with socket.socket() as s:
        s.bind((host, port))
        return s.getsockname()[1]
