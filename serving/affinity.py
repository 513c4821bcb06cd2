"""Cores of a node started by `cpuserve serve`: the engines' apart from the serving processes' where there are spare.

On a node with more cores than its replicas' engines use, Ray's processes (GCS, raylet, Serve's controller and
proxy, the ingress, the replicas' own Ray threads) run on the spare cores and every engine on cores of its own:

    cores 0 .. n-1 of this process's affinity mask, n = replicas x cpus_per_replica + spare
    [replica 0's engine | replica 1's engine | ... | serving processes (the spare cores)]

An engine's OpenMP threads wait for each other at the end of every parallel region, so a serving process that
preempts one of them costs the engine about twice its own CPU (docs/measurements/history.md). Without spare
cores everything shares all of them, as before. `cpuserve serve` decides at start (split_cores) and hands the
engines' cores to the replicas in CPUSERVE_ENGINE_CORES; each replica takes its slice by its rank on the node
(engine_cores). CPUSERVE_SPLIT_CORES=0 turns this off.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

from cpuserve.engine import settings

ENGINE_CORES_ENV = settings.ENGINE_CORES.name


def split_cores(cores: list[int], num_engine_cores: int) -> tuple[list[int], list[int]] | None:
    """(the engines' cores, the serving processes' cores) when `cores` has more than the engines need, else None."""
    if not settings.SPLIT_CORES.get() or len(cores) <= num_engine_cores:
        return None
    cores = sorted(cores)
    return cores[:num_engine_cores], cores[num_engine_cores:]


@contextlib.contextmanager
def on_cores(cores: list[int] | None) -> Iterator[None]:
    """Within: this thread on `cores` (None: as it is); the threads and processes it starts meanwhile inherit them,
    and it gets its own mask back after."""
    if not cores:
        yield
        return
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


def engine_cores(local_rank: int, cpus_per_replica: int) -> list[int] | None:
    """This replica's engine cores (its slice of CPUSERVE_ENGINE_CORES by its rank on the node), or None."""
    given = settings.ENGINE_CORES.get()
    if not given:
        return None
    cores = [int(c) for c in given.split(",")]
    mine = cores[local_rank * cpus_per_replica:(local_rank + 1) * cpus_per_replica]
    return mine if len(mine) == cpus_per_replica else None
