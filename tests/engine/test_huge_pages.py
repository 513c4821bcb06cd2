"""engine/huge_pages.py: the weights and KV pools end up on 2 MiB pages, as the kernel's own accounting
(/proc/self/smaps, AnonHugePages of the mapping holding the tensor) reports them, and CPUSERVE_HUGE_PAGES=0 leaves
them alone."""
from __future__ import annotations

import mmap
import time
from pathlib import Path

import pytest
import torch
from resident import missing_bytes, smaps_kb

from cpuserve.engine import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                                reason="transparent huge pages are off on this kernel ([never] or absent)")
MB = 1 << 20


def anon_huge_kb(t: torch.Tensor) -> int:
    return smaps_kb(t, "AnonHugePages")


def fresh(nbytes: int, fill: int | None = None) -> torch.Tensor:
    """A uint8 tensor on a private anonymous mapping of its own: fresh 4 KiB pages. From malloc, a tensor of a few
    MiB can come back in heap memory that an earlier test left on huge pages (a 16 MiB one once had 12 MiB of them
    already, and nothing left to collapse)."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(buf, dtype=torch.uint8)  # holds buf
    return t.fill_(fill) if fill is not None else t


def test_regions_cover_the_storage_in_aligned_steps():
    t = torch.ones(5 * MB, dtype=torch.uint8)
    starts = huge_pages.regions([t, t[MB:]])  # a view adds nothing: its storage is the same
    begin, end = t.data_ptr(), t.data_ptr() + t.numel()
    assert all(s % huge_pages.HUGE == 0 for s in starts)
    assert starts == sorted(set(starts))
    assert starts[0] <= begin < starts[0] + huge_pages.HUGE and starts[-1] < end <= starts[-1] + huge_pages.HUGE
    assert len(starts) == (starts[-1] - starts[0]) // huge_pages.HUGE + 1  # no gaps
    assert huge_pages.regions([torch.empty(0)]) == []


def test_collapse_puts_written_memory_on_huge_pages(monkeypatch):
    monkeypatch.delenv(huge_pages.ENV, raising=False)
    t = fresh(16 * MB, 7)  # written: on 4 KiB pages under THP's madvise mode
    before = anon_huge_kb(t)
    collapsed = huge_pages.collapse([t])
    # the interior 2 MiB regions (at least 6 of the 8 the 16 MiB span) are whole inside its mapping
    assert collapsed >= 12 * MB, f"collapsed only {collapsed} bytes"
    assert anon_huge_kb(t) >= before + 12 * 1024
    assert bool((t == 7).all())  # same contents


def test_advise_before_the_first_write(monkeypatch):
    monkeypatch.delenv(huge_pages.ENV, raising=False)
    t = fresh(16 * MB)
    huge_pages.advise([t])
    t.fill_(1)
    assert anon_huge_kb(t) >= 12 * 1024


def test_zeroed_holds_no_memory_until_written_then_huge_pages(monkeypatch):
    """A read first (an attention kernel reading a whole block) maps the zero page and holds nothing; a write after
    it still gets 2 MiB pages (a shared mapping, mmap's default, would be shmem: 4 KiB pages)."""
    monkeypatch.delenv(huge_pages.ENV, raising=False)
    t = huge_pages.zeroed((4, 2 * MB), torch.float32)  # 32 MiB, as a KV pool's scales
    assert t.shape == (4, 2 * MB) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE == 0
    assert smaps_kb(t, "Rss") == 0  # nothing written: no page yet
    assert not bool(t.any())  # and it reads as zeros
    assert smaps_kb(t, "Rss") == 0
    t[1:3].fill_(1.5)
    assert anon_huge_kb(t) >= 12 * 1024 and smaps_kb(t, "Rss") <= 20 * 1024  # the written half, on 2 MiB pages
    assert float(t.sum()) == 1.5 * 2 * 2 * MB


def test_off_leaves_pages_alone(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "0")
    t = fresh(16 * MB, 7)
    before = anon_huge_kb(t)
    assert huge_pages.collapse([t]) == 0
    assert anon_huge_kb(t) == before


def test_the_runner_backs_weights_and_pools(llm_int4):
    from cpuserve.engine.sampling_params import SamplingParams

    llm_int4.generate(["Huge pages"], SamplingParams(max_tokens=2, temperature=0))  # the pools' first writes
    model = llm_int4.engine.runner.model
    biggest = max((b for m in model.modules() for b in m.buffers(False)), key=lambda b: b.untyped_storage().nbytes())
    pool = model.layers[0].attention.kv.kv
    assert biggest.untyped_storage().nbytes() >= 4 * MB, "SmolLM2 should have a weight of several MiB"
    assert anon_huge_kb(biggest) > 0, "the largest weight is not on 2 MiB pages"
    assert anon_huge_kb(pool) > 0, "the KV pool is not on 2 MiB pages"


def test_populate_faults_pages_in_and_keeps_what_they_hold(monkeypatch):
    """MADV_POPULATE_WRITE: the pages become resident (on 2 MiB pages where advised) as a first write would make
    them, and nothing they hold changes."""
    monkeypatch.delenv(huge_pages.ENV, raising=False)
    t = huge_pages.zeroed((4, 2 * MB), torch.float32)  # 4 rows of 8 MiB
    t[0, 5] = 3.0  # row 0 holds a value (a block in use)
    if not huge_pages.populate(t[0:3]):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
    assert smaps_kb(t, "Rss") >= 24 * 1024 and anon_huge_kb(t) >= 20 * 1024  # rows 0-2 resident, on 2 MiB pages
    assert smaps_kb(t, "Rss") <= 26 * 1024  # row 3 was not asked for
    assert float(t[0, 5]) == 3.0 and float(t.abs().sum()) == 3.0
    assert huge_pages.populate(t[3:3])  # nothing to do is done


def test_an_idle_engine_faults_its_kv_pool_in_and_keeps_the_cached_blocks(llm_int4):
    """Served, no step waits for the kernel to zero a fresh page of the pool (huge_pages.populate): AsyncLLMEngine
    faults the pools in while idle. Blocks already in use keep their K and V: a prompt run before is a prefix-cache hit
    afterwards, with the same greedy tokens."""
    from cpuserve.engine.async_engine import AsyncLLMEngine
    from cpuserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0)
    prompt = "Huge pages keep a pool resident, and nothing in it changes. " * 6  # a few whole blocks to cache
    before = llm_int4.generate([prompt], params)[0]
    runner = llm_int4.engine.runner
    if not huge_pages.populate(runner.kv_pools[0][:0]) or not huge_pages.populate(runner.kv_pools[0][:1]):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
    engine = AsyncLLMEngine(llm_int4.engine)
    try:
        for _ in range(600):  # 0.25 GiB of pools: well under a second on a quiet machine
            if runner.kv_populated:
                break
            time.sleep(0.05)
    finally:
        engine.shutdown()
    assert missing_bytes(runner.kv_pools) == 0, "a KV pool is not all resident"
    after = llm_int4.generate([prompt], params)[0]
    assert after.num_cached_tokens > 0 and after.token_ids == before.token_ids
