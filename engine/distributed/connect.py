"""Join a replica group's communicator: pick the transport, rendezvous, return a Communicator.

Rendezvous is by environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), so the same code runs as
processes spawned by the engine, as Ray actors on one node and as separate pods.
"""

from __future__ import annotations

import ipaddress
import os
import socket

from cpuserve.engine import settings
from cpuserve.engine.distributed.communicator import Communicator

TRANSPORTS = ("shm", "torch")


def env_rendezvous() -> tuple[int, int, str, int]:
    """(rank, world_size, master_addr, master_port) from the environment; ValueError naming what is missing."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(f"rendezvous needs environment variables {missing}: set RANK, WORLD_SIZE, MASTER_ADDR "
                         f"and MASTER_PORT on every rank")
    return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]))


def is_local_address(addr: str) -> bool:
    """True when MASTER_ADDR is this host: then every rank that reaches it through shared memory is local too."""
    try:
        ip = ipaddress.ip_address(socket.gethostbyname(addr))
    except (OSError, ValueError):
        return False
    if ip.is_loopback:
        return True
    try:
        return str(ip) in socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        return False


def make_communicator(transport: str | None = None, timeout: float = 120.0,
                      rendezvous: tuple[int, int, str, int] | None = None, startup_check=None) -> Communicator:
    """Join the group described by the environment.

    Args:
        transport: "shm" (all ranks on this host), "torch" (torch.distributed: ccl if importable, else gloo), or
            None: CPUSERVE_COMM if set, else shm when MASTER_ADDR is this host, else torch.
        timeout: seconds a collective may wait for a live peer before the group counts as broken.
        rendezvous: (rank, world_size, master_addr, master_port) instead of the environment (a process that
            hosts rank 0 beside other work should not rewrite its own environment).
        startup_check: shm only: returns why the group cannot form while peers are awaited, or None.
    """
    rank, world, addr, port = rendezvous or env_rendezvous()
    transport = transport or settings.COMM.get() or ("shm" if is_local_address(addr) else "torch")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r} is not supported; use one of {TRANSPORTS}")
    if transport == "shm":
        from cpuserve.engine.distributed.shm import ShmCommunicator

        return ShmCommunicator(rank, world, group_name=f"{addr}-{port}", timeout=timeout,
                               startup_check=startup_check)
    from cpuserve.engine.distributed.torch_dist import TorchDistCommunicator

    return TorchDistCommunicator(rank, world, addr, port, timeout=timeout)
