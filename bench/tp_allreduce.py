"""All-reduce latency of the shm transport against torch.distributed gloo, 2 ranks pinned to one core each.

Part of bench/tp.py; its rank bodies live here so spawned processes can import them by name.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import time

SIZES = (576, 2048, 8192, 65536)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, transport: str, sizes, iters: int, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    import torch

    from cpuserve.engine.distributed.communicator import make_communicator

    torch.set_num_threads(1)
    comm = make_communicator(transport)
    out = {}
    for n in sizes:
        x = torch.randn(n)
        for _ in range(max(5, iters // 10)):
            comm.all_reduce(x)
        laps = []
        for _ in range(5):  # median of 5 batches: the machine is shared
            comm.broadcast(torch.zeros(1))  # line the ranks up before each timed batch
            start = time.perf_counter()
            for _ in range(iters):
                comm.all_reduce(x)
            laps.append((time.perf_counter() - start) / iters)
        out[n] = statistics.median(laps)
    comm.close()
    results.put((rank, out))


def measure(transport: str, sizes=SIZES, iters: int = 200) -> dict[int, float]:
    """{num_floats: seconds per all-reduce} as rank 0 sees it."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, transport, sizes, iters, results), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=300) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return got[0]


def table(iters: int = 200) -> list[str]:
    shm, gloo = measure("shm", iters=iters), measure("torch", iters=max(20, iters // 10))
    rows = ["| floats | shm (us) | gloo (us) | gloo / shm |", "|---:|---:|---:|---:|"]
    for n in SIZES:
        rows.append(f"| {n} | {shm[n] * 1e6:.1f} | {gloo[n] * 1e6:.1f} | {gloo[n] / shm[n]:.0f}x |")
    return rows
