"""CPU binding of a rank: its CPU set from CPUSERVE_CPUS ("0-27|28-55", one entry per rank) or a share of the
affinity mask; torch threads = that many cores."""

from __future__ import annotations

import logging
import os

from cpuserve.engine import settings


log = logging.getLogger(__name__)


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    if not cpus:
        raise ValueError(f"empty CPU list {text!r}: give ranges like '0-27' or '0,2,4'")
    return cpus


def rank_cpu_sets(world_size: int, spec: str | None = None, mask: list[int] | None = None) -> list[list[int]]:
    """The CPU set of every rank: CPUSERVE_CPUS when set, else the affinity mask split into contiguous shares.

    With fewer cores than ranks, ranks share cores round-robin (correct, but they then compete for them).
    """
    spec = settings.CPUS.get() if spec is None else spec
    if spec:
        entries = spec.split("|")
        if len(entries) != world_size:
            raise ValueError(f"CPUSERVE_CPUS={spec!r} has {len(entries)} entries for ranks={world_size}: give one "
                             f"CPU list per rank, separated by '|' (for example '0-27|28-55')")
        return [parse_cpu_list(e) for e in entries]
    mask = sorted(os.sched_getaffinity(0)) if mask is None else mask
    if len(mask) < world_size:
        log.warning("%d cores in the affinity mask for %d ranks: ranks share cores", len(mask), world_size)
        return [[mask[r % len(mask)]] for r in range(world_size)]
    share = len(mask) // world_size
    return [mask[r * share: (r + 1) * share] for r in range(world_size)]


def bind_rank(rank: int, cpus: list[int], num_threads: int | None = None) -> int:
    """Pin this thread (and the threads it starts) to cpus and size torch's pool to match; returns threads."""
    os.sched_setaffinity(0, cpus)
    threads = num_threads or len(cpus)
    import torch  # here: `cpuserve serve` checks CPU counts without loading torch

    torch.set_num_threads(threads)
    log.info("rank %d bound to cpus %s, torch threads=%d", rank, _ranges(cpus), threads)
    return threads


def _ranges(cpus: list[int]) -> str:
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return ",".join(out)


def check_cpu_count(name: str, count: int) -> None:
    """Refuse `count` CPUs per rank (a field or flag `name`) above the cores this process may run on."""
    mask = sorted(os.sched_getaffinity(0))
    if count > len(mask):
        raise ValueError(f"{name}={count} exceeds the {len(mask)} cores this process may run on "
                         f"(affinity mask {_ranges(mask)}); use {name} <= {len(mask)}")
