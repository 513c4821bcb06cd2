"""All-reduce latency of the shm transport against torch.distributed gloo, 2 ranks pinned to one core each.

"shm": all-reduce of an existing tensor. The next two columns time a producer writing its n floats too (here a
copy_ stands in for a matmul's output): "copied", into a fresh tensor the all-reduce then copies into the slot (the
data path before next_buffer); "zero-copy", straight into the slot from Communicator.next_buffer.

Part of bench/tp.py; its rank bodies live here so spawned processes can import them by name.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time

from cpuserve.serving.ports import free_port

SIZES = (576, 2048, 8192, 65536)


def _rank(rank: int, world: int, port: int, transport: str, sizes, iters: int, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    import torch

    from cpuserve.engine.distributed.connect import make_communicator

    torch.set_num_threads(1)
    comm = make_communicator(transport)
    out = {}
    for n in sizes:
        x = torch.randn(n)
        out[n] = _time(comm, lambda: comm.all_reduce(x), iters)
        if transport == "shm":
            out[n, "copied"] = _time(comm, lambda: comm.all_reduce(torch.empty_like(x).copy_(x)), iters)
            out[n, "zero-copy"] = _time(comm, lambda: comm.all_reduce(comm.next_buffer((n,), x.dtype).copy_(x)), iters)
    comm.close()
    results.put((rank, out))


def _time(comm, all_reduce, iters: int) -> float:
    for _ in range(max(5, iters // 10)):
        all_reduce()
    laps = []
    for _ in range(5):  # median of 5 batches: the machine is shared
        comm.barrier()  # line the ranks up before each timed batch
        start = time.perf_counter()
        for _ in range(iters):
            all_reduce()
        laps.append((time.perf_counter() - start) / iters)
    return statistics.median(laps)


def measure(transport: str, sizes=SIZES, iters: int = 200) -> dict:
    """{num_floats: seconds per all-reduce; shm also (num_floats, "copied" / "zero-copy")}, as rank 0 sees it."""
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
    rows = ["| floats | shm (us) | write + shm, copied (us) | write + shm, zero-copy (us) | gloo (us) | gloo / shm |",
            "|---:|---:|---:|---:|---:|---:|"]
    for n in SIZES:
        rows.append(f"| {n} | {shm[n] * 1e6:.1f} | {shm[n, 'copied'] * 1e6:.1f} | {shm[n, 'zero-copy'] * 1e6:.1f} | "
                    f"{gloo[n] * 1e6:.1f} | {gloo[n] / shm[n]:.0f}x |")
    return rows
