"""The /dev/shm segment of the shared-memory transport (shm.py): created whole, attached, and peers' liveness.

Rank 0 creates the segment under a temporary name and renames it, so a peer never maps a half-built file.
"""

from __future__ import annotations

import mmap
import os
import time

from cpuserve.engine.distributed.communicator import RankFailedError


def alive(pid: int) -> bool:
    """A zombie (exited, not yet reaped: a rank whose parent is rank 0) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]  # the field after "(comm)"
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def create(path: str, size: int) -> mmap.mmap:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)  # zero-filled: every seq starts at 0
        mm = mmap.mmap(fd, size)
        os.replace(tmp, path)  # atomic: a peer sees the full-size file or nothing
    except BaseException:
        os.unlink(tmp)
        raise
    finally:
        os.close(fd)
    return mm


def attach(path: str, size: int, timeout: float) -> mmap.mmap:
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(path, os.O_RDWR)
            break
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise RankFailedError(f"shm rendezvous: {path} did not appear within {timeout}s: is rank 0 up, "
                                      f"with the same MASTER_ADDR/MASTER_PORT?") from None
            time.sleep(0.005)
    try:
        if os.fstat(fd).st_size != size:
            raise ValueError(f"shm segment {path} is {os.fstat(fd).st_size} bytes, expected {size}: the ranks "
                             f"disagree on WORLD_SIZE or slot size")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
