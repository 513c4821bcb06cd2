from cpuserve.engine.block_manager import BlockManager

from factories import make_request


def test_allocate_covers_tokens_and_free_returns_blocks_tail_first():
    bm = BlockManager(num_blocks=8, block_size=4)
    r = make_request("a", list(range(1, 11)))  # 10 tokens -> 3 blocks
    assert bm.allocate_slots(r, 10)
    assert r.block_ids == [0, 1, 2]
    assert bm.num_free_blocks == 5
    r.num_computed_tokens = 10
    bm.cache_full_blocks(r)  # blocks 0 and 1 are full and hashed, block 2 is not
    bm.free(r)
    assert bm.num_free_blocks == 8 and r.block_ids == []
    order = list(bm.free_queue)
    # the unhashed tail block is reused first; of the cached ones the tail (1) is evicted before the head (0)
    assert order[0] == 2
    assert order.index(1) < order.index(0)


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    r = make_request("a", list(range(1, 13)))
    assert not bm.allocate_slots(r, 12)
    assert r.block_ids == [] and bm.num_free_blocks == 2


def test_prefix_cache_hit_verifies_tokens_and_shares_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_ids[:2]
    assert bm.allocate_slots(b, 2, hits)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert bm.blocks[hits[0]].ref_count == 2
    c = make_request("c", [1, 2, 3, 9, 5])  # differs inside the first block: no hit
    assert bm.get_computed_blocks(c) == []


def test_hit_on_a_freed_cached_block_takes_it_back_from_the_free_queue():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert bm.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    cached = a.block_ids[0]
    bm.free(a)
    b = make_request("b", [1, 2, 3, 4, 6])
    hits = bm.get_computed_blocks(b)
    assert hits == [cached]
    assert bm.allocate_slots(b, 1, hits)
    assert cached not in bm.free_queue and bm.num_free_blocks == 2


def test_whole_prompt_cached_still_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8])
    assert len(bm.get_computed_blocks(b)) == 1  # the last block is recomputed so the model yields logits
