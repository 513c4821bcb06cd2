"""The communicator on real rank processes, for both transports: collectives, sizes, dtypes, a dead peer,
zero-copy buffers."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from comm_workers import SIZES, collectives, peer_dies, reference, reference_cols, slow_reader, zero_copy
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


@pytest.mark.parametrize("transport,world", [("shm", 2), ("shm", 3), ("torch", 2)])
def test_zero_copy_collectives_give_the_copying_bits(transport, world):
    results = run_ranks(zero_copy, transport, world=world, timeout=120)
    for rank, r in results.items():
        assert not isinstance(r, Exception), r
    widths = [3, 5, 2][:world]
    for dtype in (torch.float32, torch.bfloat16):
        for n in SIZES:
            fits = n * dtype.itemsize <= 256 << 10
            for rank in range(world):
                r = results[rank]
                assert torch.equal(r[("all_reduce", dtype, n, "zero")], r[("all_reduce", dtype, n, "copy")])
                assert torch.equal(r[("all_reduce", dtype, n, "zero")], results[0][("all_reduce", dtype, n, "copy")])
                assert r[("in_slot", dtype, n)] == (transport == "shm" and fits), (dtype, n)
        for rows in (4, 20_000):
            want = torch.cat([reference_cols(r, rows, w, dtype) for r, w in enumerate(widths)], 1)
            for rank in range(world):
                r = results[rank]
                assert torch.equal(r[("gather", dtype, rows, "zero")], want), (dtype, rows, rank)
                assert torch.equal(r[("gather", dtype, rows, "copy")], want)
                fits = rows * max(widths) * dtype.itemsize <= 256 << 10
                assert r[("gather_in_slot", dtype, rows)] == (transport == "shm" and fits)
    if transport == "shm":
        assert all("next_buffer((576,), torch.float32)" in results[r]["misuse"] for r in range(world))


def test_next_buffer_waits_for_a_slow_reader_of_that_buffer():
    results = run_ranks(slow_reader, world=2, timeout=60)
    for rank, r in results.items():
        assert not isinstance(r, Exception), r
    assert results[1]["intact"], "rank 0 overwrote a slot rank 1 was still reading"
    assert results[0]["waited"] > 0.5, results[0]  # held back until rank 1 published collective 2
    assert [r["first"] for r in results.values()] == [3.0, 3.0]
    assert [r["third"] for r in results.values()] == [30.0, 30.0]
