"""Run a function on k real rank processes (multiprocessing spawn, one core each when the machine has them)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import traceback

from cpuserve.serving.ports import free_port


def _entry(target, rank: int, world: int, port: int, args: tuple, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    import torch

    torch.set_num_threads(1)
    try:
        # plain pickle: the queue's pickler would pass tensors as shared fds that die with this process
        results.put((rank, "ok", pickle.dumps(target(rank, world, *args))))
    except BaseException as e:  # report, then exit non-zero
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1)


def run_ranks(target, *args, world: int = 2, timeout: float = 60.0, wait_for: set[int] | None = None) -> dict:
    """target(rank, world, *args) on each rank; returns {rank: result} for the ranks in wait_for (default all).

    Kills every process still alive at the end (timeout, error, or a rank the test made exit silently).
    """
    wait_for = set(range(world)) if wait_for is None else wait_for
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(target, r, world, port, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    try:
        while not wait_for <= set(out):
            try:
                rank, status, value = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(wait_for - set(out))} gave no result in {timeout}s")
            out[rank] = pickle.loads(value) if status == "ok" else RuntimeError(value)
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    return out
