"""The communicator on 2 real rank processes, for both transports: collectives, sizes, dtypes, a dead peer."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from comm_workers import SIZES, collectives, peer_dies, reference
from rank_procs import run_ranks


def _segments() -> set[str]:
    return set(glob.glob(f"/dev/shm/cpuserve-{os.getuid()}-*"))


@pytest.mark.parametrize("transport", ["shm", "torch"])
def test_collectives_match_local_arithmetic(transport):
    before = _segments()
    results = run_ranks(collectives, transport, timeout=120)
    for rank, r in results.items():
        assert not isinstance(r, Exception), r
    for dtype in (torch.float32, torch.bfloat16):
        for n in SIZES:
            inputs = reference(2, dtype, n)
            total = (inputs[0].float() + inputs[1].float()).to(dtype)  # one rounding, as a 2-rank sum gives
            for rank in (0, 1):
                got = results[rank][("all_reduce", dtype, n)]
                assert got.dtype == dtype and torch.equal(got, total), (transport, dtype, n, rank)
                assert torch.equal(results[rank][("broadcast", dtype, n)], inputs[1])
            assert torch.equal(results[0][("gather", dtype, n)], torch.stack(inputs))
            assert results[1][("gather", dtype, n)] is None
    for rank in (0, 1):
        assert results[rank]["broadcast_ints"].tolist() == [0, 3, 6, 9, 12, 15, 18]
        assert results[rank]["stats_ops"] == 2 * len(SIZES) * 3 + 2
    assert _segments() == before  # the segment is unlinked once both ranks attached


def test_dead_peer_raises_instead_of_hanging_shm():
    results = run_ranks(peer_dies, "shm", timeout=60, wait_for={0})
    assert results[0].startswith("raised after"), results[0]
    assert "rank 1" in results[0] and "exited" in results[0]
