"""Rank bodies for test_communicator (spawned processes import them by name)."""

from __future__ import annotations

import os
import time

import torch

from cpuserve.engine.distributed.communicator import RankFailedError, make_communicator

SIZES = (1, 576, 65536, 100_003)  # 100_003 fp32 > the 256 KiB slot used for shm: exercises chunking


def _make(transport: str):
    if transport == "shm":
        from cpuserve.engine.distributed.shm import ShmCommunicator

        return ShmCommunicator(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                               group_name=f"test-{os.environ['MASTER_PORT']}", slot_bytes=256 << 10, timeout=20)
    return make_communicator(transport, timeout=20)


def _data(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    return torch.randn(n, generator=g).to(dtype)


def collectives(rank: int, world: int, transport: str) -> dict:
    """Every collective on every size and dtype; returns what the parent checks against its own arithmetic."""
    comm = _make(transport)
    out = {}
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for n in SIZES:
                x = _data(rank, n, dtype)
                out[("all_reduce", dtype, n)] = comm.all_reduce(x.clone())
                out[("broadcast", dtype, n)] = comm.broadcast(x.clone().reshape(-1, 1), src=world - 1).reshape(-1)
                out[("gather", dtype, n)] = comm.gather(x.clone(), dst=0)
        ints = torch.arange(7, dtype=torch.int64) * 3 if rank == 0 else None
        out["broadcast_ints"] = comm.broadcast_ints(ints)
        out["stats_ops"] = comm.stats.num_ops
    finally:
        comm.close()
    return out


def reference(world: int, dtype: torch.dtype, n: int) -> list[torch.Tensor]:
    return [_data(r, n, dtype) for r in range(world)]


def peer_dies(rank: int, world: int, transport: str) -> str:
    """Rank 1 exits after one all-reduce; rank 0's next all-reduce must raise RankFailedError, not hang."""
    comm = _make(transport)
    x = torch.ones(576)
    comm.all_reduce(x)
    if rank == 1:
        os._exit(0)  # no goodbye, as a killed process
    start = time.monotonic()
    try:
        comm.all_reduce(x)
    except RankFailedError as e:
        return f"raised after {time.monotonic() - start:.1f}s: {e}"
    finally:
        comm.close()
    return "no error"
