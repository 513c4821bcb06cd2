"""What the kernel reports resident: a tensor's pages (mincore), a field of /proc/self/smaps over the mappings that
hold a tensor, and the Rss of another process (a replica group's rank)."""
from __future__ import annotations

import ctypes
import mmap
import re
from pathlib import Path

import numpy as np
import torch

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def smaps_kb(t: torch.Tensor, field: str) -> int:
    """A field of /proc/self/smaps summed over the mappings that hold t's storage (a madvise may have split one)."""
    begin = t.untyped_storage().data_ptr()
    end, total, inside = begin + t.untyped_storage().nbytes(), 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) < end and begin < int(head.group(2), 16)
        elif inside and line.startswith(f"{field}:"):
            total += int(line.split()[1])
    return total


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of t's pages that are resident, page by page (mincore(2)). Exact where smaps is not: the kernel merges
    neighbouring mappings with the same flags (every KV pool's), and a merged mapping's Rss is all of theirs."""
    page = mmap.PAGESIZE
    start = t.data_ptr() - t.data_ptr() % page
    pages = -(-(t.data_ptr() + t.nbytes - start) // page)
    vec = np.zeros(pages, dtype=np.uint8)
    if _libc.mincore(start, pages * page, vec.ctypes.data) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return int((vec & 1).sum()) * page


def missing_bytes(pools: list[torch.Tensor]) -> int:
    """Bytes of these tensors not yet resident."""
    return sum(max(0, p.nbytes - resident_bytes(p)) for p in pools)


def process_rss_kb(pid: int) -> int:
    """The Rss line of /proc/<pid>/smaps_rollup: every resident page of that process."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/{pid}/smaps_rollup has no Rss line")
