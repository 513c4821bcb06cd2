"""Back the weights and KV pools with 2 MiB pages: a decode step streams every weight once, and on 4 KiB pages
that is a TLB miss every 4 KiB (a 3B model's 1.7 GB of layers: 425,000 page walks a token).

Most Linux hosts run transparent huge pages in `madvise` mode, so memory torch allocates stays on 4 KiB pages unless
someone asks. The runner asks twice (engine/model_runner.py):
- the KV pools, mapped fresh (`zeroed`) and advised before their first write (`advise`): the page faults that
  zero them then take 2 MiB pages. Served, the engine faults them in while it has nothing to do (`populate`,
  AsyncLLMEngine's idle time), so no step waits for the kernel to zero a pool's fresh pages; a pod's memory holds
  all of it (operator/memory.py counts the whole KV budget);
- the weights, once built (`collapse`): each 2 MiB-aligned region holding one is collapsed in place (MADV_COLLAPSE,
  Linux 6.1+), synchronously, with no copy that would raise peak RSS, and every tensor (and every view a module took
  of it) keeps its address. A kernel without MADV_COLLAPSE gets MADV_HUGEPAGE: khugepaged collapses in the background.
A region that cannot be collapsed (the edge of a tensor whose neighbour is another mapping) stays as it is: this
changes speed, never results. Measured on a 2-core EPYC, one process holding both forms of a model: batch-1 decode
1.03x at Llama 3.2 1B and 3B shapes. CPUSERVE_HUGE_PAGES=0 turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
from collections.abc import Iterable

import torch

from cpuserve.engine import settings

log = logging.getLogger(__name__)

ENV = settings.HUGE_PAGES.name
HUGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE, MADV_POPULATE_WRITE = 14, 25, 23


def enabled() -> bool:
    return settings.HUGE_PAGES.get()


def regions(tensors: Iterable[torch.Tensor]) -> list[int]:
    """The start of every 2 MiB-aligned region that holds some byte of these tensors' storage, sorted."""
    starts: set[int] = set()
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            continue
        first, end = storage.data_ptr() // HUGE, (storage.data_ptr() + storage.nbytes() - 1) // HUGE + 1
        starts.update(range(first * HUGE, end * HUGE, HUGE))
    return sorted(starts)


def _runs(starts: list[int]) -> list[tuple[int, int]]:
    """Adjacent regions merged: (address, length) per run, so one madvise covers each."""
    runs: list[tuple[int, int]] = []
    for s in starts:
        if runs and runs[-1][0] + runs[-1][1] == s:
            runs[-1] = (runs[-1][0], runs[-1][1] + HUGE)
        else:
            runs.append((s, HUGE))
    return runs


@functools.cache
def _glibc():
    """glibc's madvise, or None where this is not glibc"""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not glibc: leave the pages as they are
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _libc():
    """glibc's madvise, or None where huge pages are turned off or this is not glibc"""
    return _glibc() if enabled() else None


def populate(tensor: torch.Tensor) -> bool:
    """Fault in the pages under a contiguous `tensor` as its first write would (2 MiB pages where advised), without
    writing: its values stay. A step that writes there later finds them resident. In a VM, the first write to a
    fresh page can cost the guest's zeroing and the host's backing: 60 such 2 MiB pages (one block boundary of a
    30-layer int8 pool) stalled a batch-8 decode step of 6 ms for 150 ms, nearly all of it kernel time (Zen 5, 2 cores).
    False where the kernel (before Linux 5.14) or libc cannot: pages are then faulted in by their first write."""
    libc = _glibc()
    if libc is None or not tensor.is_contiguous() or tensor.numel() == 0:
        return libc is not None and tensor.numel() == 0
    start = tensor.data_ptr() - tensor.data_ptr() % mmap.PAGESIZE
    return libc.madvise(start, tensor.data_ptr() + tensor.nbytes - start, MADV_POPULATE_WRITE) == 0


def advise(tensors: Iterable[torch.Tensor]) -> None:
    """Before first touch (torch.empty, then fill): the page faults themselves then allocate 2 MiB pages, where the
    aligned region lies inside the mapping, at no extra cost."""
    libc = _libc()
    if libc is None:
        return
    for address, length in _runs(regions(tensors)):
        libc.madvise(address, length, MADV_HUGEPAGE)  # a run crossing other mappings is advised where it can be


def zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of zeros on fresh private anonymous pages, 2 MiB-aligned and advised for 2 MiB pages: the kernel
    zeroes each page at its first write, so nothing is written now. torch.zeros writes every byte at once: 1.2
    CPU-seconds for a 1 GiB KV pool on a 2-core Xeon, a second of every replica's start, for pages most short runs
    never use. (A shared mapping, mmap's default, would be shmem: no 2 MiB pages under THP's madvise mode.)"""
    size = torch.Size(shape).numel() * dtype.itemsize
    buf = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # untouched: no memory
    whole = torch.frombuffer(buf, dtype=torch.uint8)  # the tensor keeps the map
    start = -whole.data_ptr() % HUGE
    tensor = whole[start:start + size]
    advise([tensor])
    return tensor.view(dtype).view(shape)


def collapse(tensors: Iterable[torch.Tensor]) -> int:
    """Memory already written (the weights): collapse it in place; returns the bytes now on 2 MiB pages."""
    libc = _libc()
    if libc is None:
        return 0
    collapsed = left = 0
    starts = regions(tensors)
    runs = _runs(starts)
    log.info("huge pages: collapsing %.0f MB of weights into 2 MiB pages (a few seconds a GB)",
             len(starts) * HUGE / 1e6)
    for address, length in runs:
        if libc.madvise(address, length, MADV_COLLAPSE) == 0:
            collapsed += length
            continue
        # a run's edge regions may reach past the mapping (into the heap's neighbour, a gap): collapse the rest
        for start in range(address, address + length, HUGE):
            ok = libc.madvise(start, HUGE, MADV_COLLAPSE) == 0
            collapsed, left = collapsed + HUGE * ok, left + HUGE * (not ok)
    if runs and not collapsed:  # a kernel before 6.1 has no MADV_COLLAPSE: khugepaged collapses advised memory
        for address, length in runs:
            libc.madvise(address, length, MADV_HUGEPAGE)
    log.info("huge pages: %.0f MB of weights collapsed into 2 MiB pages (%.0f MB in edge regions left)",
             collapsed / 1e6, left / 1e6)
    return collapsed
