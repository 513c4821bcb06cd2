"""Thread binding: torch uses the cores of this process's own affinity mask, never the host's core count."""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)


def affinity_cores() -> list[int]:
    """The CPUs this process may run on; a container's cpuset (or taskset) is the truth."""
    return sorted(os.sched_getaffinity(0))


def configure_threads(num_threads: int | None = None) -> int:
    cores = affinity_cores()
    n = num_threads or len(cores)
    if n > len(cores):
        log.warning("num_threads=%d exceeds the %d cores in the affinity mask %s", n, len(cores), cores)
    torch.set_num_threads(n)
    log.info("torch threads=%d, affinity mask=%s", n, cores)
    return n
