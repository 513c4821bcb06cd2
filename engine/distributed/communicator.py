"""One communicator interface, two transports: shared memory on one host, torch.distributed across hosts.

The transports (shm.py, torch_dist.py) implement this interface; connect.py picks one and joins the group.

Every rank must call the same collectives in the same order (SPMD); the shapes and dtypes must agree.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

class RankFailedError(RuntimeError):
    """A peer rank died or stopped answering: the group is broken and must be rebuilt."""


@dataclass(slots=True)
class CommStats:
    num_ops: int = 0
    num_bytes: int = 0  # bytes of the tensors this rank passed to collectives
    seconds: float = 0.0  # wall time inside collectives, waiting for slower peers included
    copied_bytes: int = 0  # all-reduce / all-gather inputs copied into shared memory (not built there: next_buffer)

    def reset(self) -> None:
        self.num_ops, self.num_bytes, self.seconds, self.copied_bytes = 0, 0, 0.0, 0


class Communicator(ABC):
    rank: int
    world_size: int

    def __init__(self, rank: int, world_size: int):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"RANK={rank} must be in [0, WORLD_SIZE={world_size})")
        self.rank, self.world_size = rank, world_size
        self.stats = CommStats()

    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over all ranks (every rank gets the same bits): in place, returning x, except for a buffer from
        next_buffer(), whose sum comes back in a new tensor."""

    @abstractmethod
    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy src's x into every rank's x (same shape and dtype everywhere), in place; returns x."""

    @abstractmethod
    def gather(self, x: torch.Tensor, dst: int = 0) -> torch.Tensor | None:
        """[world_size, *x.shape] stacked in rank order on dst; None elsewhere."""

    def all_gather_cols(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """x [N, widths[rank]] on each rank -> [N, sum(widths)], rank 0's columns first, on every rank.

        Generic path: pad to the widest, gather at rank 0, broadcast. Transports override it with one step.
        """
        wide = max(widths)
        padded = x if x.shape[1] == wide else torch.cat([x, x.new_zeros(x.shape[0], wide - x.shape[1])], 1)
        stacked = self.gather(padded.contiguous())  # [world, N, wide] on rank 0
        if stacked is None:
            stacked = torch.empty((self.world_size, *padded.shape), dtype=x.dtype)
        self.broadcast(stacked)
        return torch.cat([stacked[r, :, :w] for r, w in enumerate(widths)], 1)

    def next_buffer(self, shape: tuple[int, ...], dtype: torch.dtype, widths: list[int] | None = None) -> torch.Tensor:
        """A contiguous tensor to build the input of this rank's next all_reduce / all_gather_cols in.

        A transport with shared memory hands out a view of this rank's own slot, so that collective need not copy
        the input (zero-copy); the others, a fresh tensor. Write it, then pass it to the very next collective this
        rank calls, and drop it afterwards: after that collective the slot belongs to the group again.

        Args:
            shape: this rank's input; for all_gather_cols [N, widths[rank]].
            dtype: its dtype.
            widths: for all_gather_cols, every rank's widths (all ranks must choose zero-copy or not alike).
        """
        return torch.empty(shape, dtype=dtype)

    @abstractmethod
    def close(self) -> None:
        """Release the transport; the communicator is unusable afterwards."""

    def broadcast_ints(self, values: torch.Tensor | None, src: int = 0, idle: bool = False) -> torch.Tensor:
        """A variable-length int64 vector from src (which passes it; the others pass None).

        idle: the receiver may wait indefinitely (a worker between steps), as long as src is alive.
        """
        n = torch.tensor([0 if values is None else values.numel()], dtype=torch.int64)
        self.broadcast(n, src)
        out = values if self.rank == src else torch.empty(int(n), dtype=torch.int64)
        return self.broadcast(out, src)

    def barrier(self, timeout: float | None = None) -> None:
        """Every rank reaches this point (timeout: seconds, None = the transport's own)."""
        self.all_reduce(torch.zeros(1))


def timed(method):
    """Count a collective's wall time and bytes into self.stats (cheap: two clock reads)."""

    def wrapper(self, x, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(self, x, *args, **kwargs)
        finally:
            self.stats.num_ops += 1
            self.stats.num_bytes += 0 if x is None else x.numel() * x.element_size()
            self.stats.seconds += time.perf_counter() - start

    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper
