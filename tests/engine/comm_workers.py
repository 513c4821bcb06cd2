"""Rank bodies for test_communicator (spawned processes import them by name)."""

from __future__ import annotations

import os
import time

import torch

from cpuserve.engine.distributed.communicator import RankFailedError
from cpuserve.engine.distributed.connect import make_communicator

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


def reference_cols(rank: int, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    return _data(rank, rows * width, dtype).view(rows, width)


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


def _in_segment(comm, t: torch.Tensor) -> bool:
    """t lives in the shm segment (a slot), not in ordinary memory."""
    data = getattr(comm, "_data", None)
    return data is not None and data.data_ptr() <= t.data_ptr() < data.data_ptr() + data.numel()


def zero_copy(rank: int, world: int, transport: str) -> dict:
    """Each all_reduce / all_gather_cols twice, copying and through next_buffer; returns both for the parent."""
    comm = _make(transport)
    widths = [3, 5, 2][:world]
    out = {}
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for n in SIZES:
                x = _data(rank, n, dtype)
                out[("all_reduce", dtype, n, "copy")] = comm.all_reduce(x.clone())
                buf = comm.next_buffer((n,), dtype)
                out[("in_slot", dtype, n)] = _in_segment(comm, buf)
                buf.copy_(x)
                result = comm.all_reduce(buf)
                assert not _in_segment(comm, result), "the sum must not stay in the slot peers read"
                out[("all_reduce", dtype, n, "zero")] = result
            for rows in (4, 20_000):  # 20_000 x 5 fp32 > the 256 KiB slot: every rank takes the generic path
                y = reference_cols(rank, rows, widths[rank], dtype)
                out[("gather", dtype, rows, "copy")] = comm.all_gather_cols(y, widths)
                buf = comm.next_buffer((rows, widths[rank]), dtype, widths)
                out[("gather_in_slot", dtype, rows)] = _in_segment(comm, buf)
                buf.copy_(y)
                out[("gather", dtype, rows, "zero")] = comm.all_gather_cols(buf, widths)
        comm.next_buffer((576,), torch.float32)
        try:
            comm.all_reduce(torch.ones(576))  # not the buffer it handed out
        except RuntimeError as e:
            out["misuse"] = str(e)
    finally:
        comm.close()
    return out


def slow_reader(rank: int, world: int) -> dict:
    """Rank 1 still reads collective 1's buffer while rank 0 asks for that buffer again (collective 3).

    Collective 2 is a broadcast from rank 0, which the sender leaves at once, so nothing but next_buffer's wait
    holds rank 0 back: the view must not come before rank 1 has published collective 2.
    """
    comm = _make("shm")
    try:
        buf = comm.next_buffer((576,), torch.float32)  # collective 1: buffer 1
        buf.fill_(rank + 1)
        first = comm.all_reduce(buf)
        if rank == 1:
            rank0_slot = comm._typed(torch.float32)[1][0][:576]  # what a reader of collective 1 reads
            time.sleep(1.0)  # a slow reader: descheduled, or a slower core
            intact = bool((rank0_slot == 1).all())
            comm.broadcast(torch.zeros(1), src=0)  # collective 2: rank 1 publishes it only now
            waited = 0.0
        else:
            comm.broadcast(torch.ones(1), src=0)  # collective 2: rank 0 posts and goes on
            start = time.monotonic()
            buf = comm.next_buffer((576,), torch.float32)  # collective 3: buffer 1 again
            waited = time.monotonic() - start
            intact = True
        if rank == 1:
            buf = comm.next_buffer((576,), torch.float32)
        buf.fill_(10 * (rank + 1))  # rank 0 overwrites its slot of buffer 1 at once
        third = comm.all_reduce(buf)
    finally:
        comm.close()
    return dict(first=first[0].item(), third=third[0].item(), intact=intact, waited=waited)
