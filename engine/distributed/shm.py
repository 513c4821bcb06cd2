"""Shared-memory transport for ranks on one host: one mmap'd segment in /dev/shm, sequence-number barriers.

Segment layout (rank 0 creates it under a temporary name and renames it, so a peer never maps a half-built file;
once every rank has attached, rank 0 unlinks it, so a crash can never leak it):

    [ control: one 64-byte line per rank: seq, pid, attached, ... (int64) ][ pad to 4 KiB ]
    [ buffer 0: slot rank 0 | slot rank 1 | ... ][ buffer 1: slot rank 0 | slot rank 1 | ... ]

Collective number s (every rank counts the same) uses buffer s % 2. A rank writes its input into its own slot,
then publishes seq = s; readers wait until the ranks they need have published s. Before writing buffer s % 2
again at s + 2, a rank waits until every peer has published s + 1, i.e. finished reading collective s, so two
buffers are enough (the same double-buffer scheme as the shm all-reduce of gloo / DeepSpeed / vLLM CPU, with a
monotonic counter instead of cycling states). Every rank sums the slots itself, in rank order, so all ranks get
identical bits without a second barrier. x86 stores are seen in program order (TSO), so the data written before
the flag is visible once the flag is.

Zero-copy: next_buffer() starts collective s early: it makes the same wait (no peer still reads buffer s % 2)
and hands out this rank's slot of that buffer as a tensor; the producer (a linear layer's out=) writes its result
there, and all_reduce / all_gather_cols given that tensor only publish s. The sum then goes to a new tensor,
since the slot must stay unchanged until every peer has read it.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import re
import time

import torch

from cpuserve.engine.distributed.communicator import Communicator, RankFailedError, timed
from cpuserve.engine.distributed.shm_segment import alive, attach, create

log = logging.getLogger(__name__)

_LINE = 8  # int64 per rank control line (64 bytes: no false sharing between ranks' flags)
_SEQ, _PID, _ATTACHED = 0, 1, 2
_HEADER = 4096
_SPIN = 2000  # busy polls before yielding the core (~100-200 us in Python)
_YIELD_SECONDS = 0.002  # then sched_yield until this much waiting, then short sleeps
_HALF = (torch.bfloat16, torch.float16)


class ShmCommunicator(Communicator):
    def __init__(self, rank: int, world_size: int, group_name: str, slot_bytes: int = 8 << 20,
                 timeout: float = 120.0, shm_dir: str = "/dev/shm", startup_check=None):
        """startup_check: called while waiting for peers to attach; returns why the group cannot form, or None
        (the engine passes one that notices a worker process that died while starting)."""
        super().__init__(rank, world_size)
        self.slot_bytes = slot_bytes
        self.timeout = timeout
        self._seq = 0
        self._peer_pids: dict[int, int] = {}
        self._views: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        self._shapes: dict[tuple, list[torch.Tensor]] = {}
        self._claimed: tuple[int, int, list[torch.Tensor]] | None = None  # next_buffer's (seq, buffer, _shaped())
        name = "cpuserve-" + re.sub(r"[^A-Za-z0-9_.-]", "_", f"{os.getuid()}-{group_name}")
        path = os.path.join(shm_dir, name)
        size = _HEADER + 2 * world_size * slot_bytes
        self._mm = create(path, size) if rank == 0 else attach(path, size, timeout)
        # ctypes indexing returns a Python int in ~50 ns (a numpy scalar read costs ~10x that): it is the spin loop
        self._ctrl = (ctypes.c_int64 * (world_size * _LINE)).from_buffer(self._mm)  # [world * 8]
        self._data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=_HEADER)  # [2 * world * slot]
        self._slots = [[self._data[(b * world_size + r) * slot_bytes: (b * world_size + r + 1) * slot_bytes]
                        for r in range(world_size)] for b in (0, 1)]  # [buffer][rank] -> [slot_bytes] uint8
        self._ctrl[rank * _LINE + _PID] = os.getpid()
        self._ctrl[rank * _LINE + _ATTACHED] = 1
        try:
            self._wait_attached(path, startup_check)
        except BaseException:
            if rank == 0 and os.path.exists(path):
                os.unlink(path)
            raise
        log.info("shm communicator: rank %d/%d, segment %s, %d MiB per slot", rank, world_size, name,
                 slot_bytes >> 20)

    # -- barrier --------------------------------------------------------------------------------------
    def _wait_attached(self, path: str, startup_check) -> None:
        deadline = time.monotonic() + self.timeout
        while not all(self._ctrl[r * _LINE + _ATTACHED] for r in range(self.world_size)):
            problem = startup_check() if startup_check is not None else None
            if problem:
                raise RankFailedError(f"shm rendezvous: {problem}")
            if time.monotonic() > deadline:
                raise RankFailedError(f"shm rendezvous: not every rank attached to {path} within {self.timeout}s")
            time.sleep(0.001)
        self._peer_pids = {r: int(self._ctrl[r * _LINE + _PID]) for r in range(self.world_size) if r != self.rank}
        if self.rank == 0:
            os.unlink(path)  # every rank has it mapped: the name is no longer needed and can never leak

    def _wait(self, ranks, seq: int, timeout: float | None) -> None:
        """Until every rank in `ranks` has published seq; RankFailedError if one dies or times out."""
        ctrl = self._ctrl
        for r in ranks:
            index = r * _LINE + _SEQ
            if ctrl[index] >= seq:
                continue
            for _ in range(_SPIN):
                if ctrl[index] >= seq:
                    break
            else:
                self._wait_slow(r, index, seq, timeout)

    def _wait_slow(self, r: int, index: int, seq: int, timeout: float | None) -> None:
        start = last_check = time.monotonic()
        while self._ctrl[index] < seq:
            now = time.monotonic()
            if now - start < _YIELD_SECONDS:
                os.sched_yield()
                continue
            time.sleep(0.0001 if now - start < 1.0 else 0.001)  # idle: back off, keep the core free
            if now - last_check > 0.2:
                last_check = now
                if not alive(self._peer_pids[r]):
                    raise RankFailedError(f"rank {r} (pid {self._peer_pids[r]}) exited: the group is broken")
                if timeout is not None and now - start > timeout:
                    raise RankFailedError(f"rank {r} did not answer collective {seq} within {timeout}s")

    def _begin(self, timeout: float | None) -> tuple[int, int]:
        """Next collective number and its buffer; first makes sure no peer still reads that buffer."""
        if self._claimed is not None:
            raise RuntimeError(f"collective {self._claimed[0]} was started by next_buffer(): the next collective "
                               f"must be the all_reduce / all_gather_cols of that buffer, not another one")
        self._seq += 1
        seq = self._seq
        if seq > 2:
            self._wait(range(self.world_size), seq - 1, timeout)
        return seq, seq & 1

    def _post(self, seq: int) -> None:
        self._ctrl[self.rank * _LINE + _SEQ] = seq

    def _slot(self, buffer: int, rank: int, nbytes: int) -> torch.Tensor:
        return self._slots[buffer][rank][:nbytes]  # [nbytes] uint8 view into the segment

    # -- zero-copy ------------------------------------------------------------------------------------
    def next_buffer(self, shape: tuple[int, ...], dtype: torch.dtype, widths: list[int] | None = None) -> torch.Tensor:
        numel = math.prod(shape)
        widest = shape[0] * max(widths) if widths else numel  # so that every rank decides alike
        if widest * dtype.itemsize > self.slot_bytes:
            return super().next_buffer(shape, dtype)  # more than one slot: the chunked, copying path
        start = time.perf_counter()
        seq, b = self._begin(self.timeout)  # the protocol's wait: no peer reads buffer b any more
        parts = self._shaped(b, dtype, tuple(shape))
        self._claimed = (seq, b, parts)
        self.stats.seconds += time.perf_counter() - start
        return parts[self.rank]

    def _shaped(self, b: int, dtype: torch.dtype, shape: tuple[int, ...]) -> list[torch.Tensor]:
        """[rank] -> the start of each rank's slot of buffer b as a dtype tensor of this shape."""
        return self._cached((b, dtype, shape), lambda: [slot[:math.prod(shape)].view(shape)
                                                        for slot in self._typed(dtype)[b]])

    def _columns(self, b: int, dtype: torch.dtype, n: int, widths: list[int]) -> list[torch.Tensor]:
        """[rank] -> rank r's slot of buffer b as [n, widths[r]] (all_gather_cols' parts)."""
        return self._cached((b, dtype, n, *widths), lambda: [slot[: n * w].view(n, w)
                                                             for slot, w in zip(self._typed(dtype)[b], widths)])

    def _cached(self, key: tuple, make) -> list[torch.Tensor]:
        """Slot views, cached: making them costs more than the copy they save; a decode step repeats its shapes."""
        parts = self._shapes.get(key)
        if parts is None:
            if len(self._shapes) >= 256:  # prefill chunks of every length: keep the cache small
                self._shapes.clear()
            parts = self._shapes[key] = make()
        return parts

    def _take(self, x: torch.Tensor) -> tuple[int, int, list[torch.Tensor]] | None:
        """(seq, buffer, every rank's part) when x is the slot next_buffer() handed out, holding this rank's part;
        None when no collective was started by next_buffer()."""
        if self._claimed is None:
            return None
        claimed, self._claimed = self._claimed, None
        view = claimed[2][self.rank]
        if x is not view:
            raise RuntimeError(f"collective {claimed[0]} was started by next_buffer({tuple(view.shape)}, {view.dtype}) "
                               f"but got another tensor {tuple(x.shape)} {x.dtype}: pass it that same tensor")
        return claimed

    # -- collectives ----------------------------------------------------------------------------------
    def _chunks(self, x: torch.Tensor):
        flat = x.view(-1)  # x: contiguous; flat: [numel]
        step = self.slot_bytes // x.element_size()
        for start in range(0, flat.numel(), step):
            yield flat[start: start + step]

    def _typed(self, dtype: torch.dtype) -> list[list[torch.Tensor]]:
        """[buffer][rank] -> the whole slot viewed as dtype (cached: a dtype view costs ~3 us per call)."""
        views = self._views.get(dtype)
        if views is None:
            views = self._views[dtype] = [[s.view(dtype) for s in row] for row in self._slots]
        return views

    @timed
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        claimed = self._take(x)
        if claimed is not None:  # zero-copy: x is our slot; it must not change until every peer has read it
            out = torch.empty_like(x)
            self._reduce(claimed[0], claimed[2], out)
            return out
        assert x.is_contiguous()
        flat = x.view(-1)  # flat: [numel]
        step = self.slot_bytes // x.element_size()
        for start in range(0, flat.numel(), step):
            self._all_reduce_part(flat[start: start + step] if flat.numel() > step else flat)
        return x

    def _all_reduce_part(self, part: torch.Tensor) -> None:
        seq, b = self._begin(self.timeout)
        n = part.numel()
        parts = self._shaped(b, part.dtype, (n,))
        # plain memmove into our slot: the cheapest copy Python can issue (a torch copy_ costs ~3 us here)
        ctypes.memmove(parts[self.rank].data_ptr(), part.data_ptr(), n * part.element_size())
        self.stats.copied_bytes += n * part.element_size()
        self._reduce(seq, parts, part)

    def _reduce(self, seq: int, parts: list[torch.Tensor], out: torch.Tensor) -> None:
        """Publish collective seq (our part is in our slot), then sum every rank's part in rank order into out."""
        self._post(seq)
        self._wait(range(self.world_size), seq, self.timeout)
        if self.world_size == 2:  # one rounding either way, so half types can add directly
            torch.add(parts[0], parts[1], out=out)
        elif out.dtype in _HALF:  # accumulate half types in fp32, round once
            acc = parts[0].float()
            for p in parts[1:]:
                acc += p
            out.copy_(acc)
        else:
            out.copy_(parts[0])
            for p in parts[1:]:
                out += p

    @timed
    def all_gather_cols(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """One barrier: every rank writes its columns to its slot, then concatenates all slots."""
        n = x.shape[0]
        claimed = self._take(x)
        if claimed is not None:  # zero-copy: x is already our slot (next_buffer checked the widest rank fits)
            seq, b, _ = claimed
        elif n * max(widths) * x.element_size() > self.slot_bytes:
            return super().all_gather_cols(x, widths)  # too big for one slot: the chunked generic path
        else:
            x = x.contiguous()
            seq, b = self._begin(self.timeout)
            ctypes.memmove(self._slots[b][self.rank].data_ptr(), x.data_ptr(), x.numel() * x.element_size())
            self.stats.copied_bytes += x.numel() * x.element_size()
        self._post(seq)
        self._wait(range(self.world_size), seq, self.timeout)
        return torch.cat(self._columns(b, x.dtype, n, widths), 1)  # [N, sum(widths)]

    @timed
    def broadcast(self, x: torch.Tensor, src: int = 0, timeout: float | None = -1.0) -> torch.Tensor:
        assert x.is_contiguous()
        timeout = self.timeout if timeout == -1.0 else timeout
        for part in self._chunks(x):
            seq, b = self._begin(timeout)
            nbytes = part.numel() * part.element_size()
            if self.rank == src:
                self._slot(b, src, nbytes).copy_(part.view(torch.uint8))
                self._post(seq)
            else:
                self._post(seq)
                self._wait((src,), seq, timeout)
                part.view(torch.uint8).copy_(self._slot(b, src, nbytes))
        return x

    @timed
    def gather(self, x: torch.Tensor, dst: int = 0) -> torch.Tensor | None:
        assert x.is_contiguous()
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype) if self.rank == dst else None
        outs = list(out.view(self.world_size, -1)) if out is not None else None  # [world][numel] views
        step = self.slot_bytes // x.element_size()
        for i, part in enumerate(self._chunks(x)):
            seq, b = self._begin(self.timeout)
            nbytes = part.numel() * part.element_size()
            self._slot(b, self.rank, nbytes).copy_(part.view(torch.uint8))
            self._post(seq)
            if outs is not None:
                self._wait(range(self.world_size), seq, self.timeout)
                for r in range(self.world_size):
                    outs[r][i * step: i * step + part.numel()].view(torch.uint8).copy_(self._slot(b, r, nbytes))
        return out

    def broadcast_ints(self, values: torch.Tensor | None, src: int = 0, idle: bool = False) -> torch.Tensor:
        n = torch.tensor([0 if values is None else values.numel()], dtype=torch.int64)
        self.broadcast(n, src, timeout=None if idle else -1.0)
        out = values if self.rank == src else torch.empty(int(n), dtype=torch.int64)
        return self.broadcast(out, src)

    def barrier(self, timeout: float | None = None) -> None:
        saved, self.timeout = self.timeout, (timeout if timeout is not None else self.timeout)
        try:
            self.all_reduce(torch.zeros(1))
        finally:
            self.timeout = saved

    def close(self) -> None:
        self._ctrl = self._data = self._slots = self._claimed = None
        self._views.clear()
        self._shapes.clear()  # drop the exported views first: mmap refuses to close under them
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a view; the mapping goes when the process does
            pass
