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


def _chain(tokens: list[int], block_size: int) -> list[int]:
    """The prefix-cache hash of every full block, computed from scratch: h_i = hash((h_{i-1}, block_i))."""
    hashes, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[i * block_size:(i + 1) * block_size])))
        hashes.append(parent)
    return hashes


def test_blocks_are_hashed_once_as_they_fill_with_the_chain_from_scratch():
    bm = BlockManager(num_blocks=16, block_size=4)
    r = make_request("a", list(range(1, 7)))  # 6 tokens: one full block
    assert bm.allocate_slots(r, 6)
    r.num_computed_tokens = 6
    bm.cache_full_blocks(r)
    assert r.num_hashed_blocks == 1
    for token in range(100, 111):  # decode 11 tokens, one a step: 17 tokens = 4 full blocks
        r.append_token(token)
        assert bm.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        bm.cache_full_blocks(r)
    assert r.num_hashed_blocks == 4
    want = _chain(r.all_token_ids, 4)
    assert [bm.blocks[b].block_hash for b in r.block_ids[:4]] == want
    assert bm.blocks[r.block_ids[4]].block_hash is None  # the partial tail


def test_a_prefix_hit_counts_as_hashed_and_the_rest_of_the_chain_continues_from_it():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_request("a", list(range(1, 10)))
    assert bm.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    b = make_request("b", list(range(1, 9)) + [50, 51, 52, 53, 54])  # shares a's two full blocks
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_ids[:2]
    assert bm.allocate_slots(b, 5, hits) and b.num_hashed_blocks == 2
    b.num_computed_tokens = 13
    bm.cache_full_blocks(b)
    assert b.num_hashed_blocks == 3
    assert [bm.blocks[x].block_hash for x in b.block_ids[:3]] == _chain(b.all_token_ids, 4)
    bm.free(b)
    assert b.num_hashed_blocks == 0  # a preempted request starts its count again


def _decode(bm: BlockManager, r, tokens: list[int]) -> None:
    for token in tokens:
        r.append_token(token)
        assert bm.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        bm.cache_full_blocks(r)


def test_keyed_by_role_a_prompt_misses_the_blocks_another_request_generated():
    """Prompt tokens and generated ones run different attention (prefill, decode) and maybe GEMM schemes (QuantLinear's
    prompt rows): a block's KV depends on which of its tokens were prompt tokens, so a later prompt holding a's output
    (the next turn of a chat) must not take a's blocks past its prompt; a's own recompute after a preemption takes them
    all."""
    for key_by_role, num_hits in ((False, 3), (True, 1)):
        bm = BlockManager(num_blocks=16, block_size=4, key_by_role=key_by_role)
        a = make_request("a", list(range(1, 7)))  # block 0: prompt; block 1: 2 prompt + 2 generated; block 2: generated
        assert bm.allocate_slots(a, 6)
        a.num_computed_tokens = 6
        bm.cache_full_blocks(a)
        _decode(bm, a, list(range(100, 107)))  # 13 tokens: 3 full blocks
        next_turn = make_request("b", a.all_token_ids + [7, 8, 9])
        assert bm.get_computed_blocks(next_turn) == a.block_ids[:num_hits], key_by_role
        blocks = list(a.block_ids)
        bm.free(a)
        a.num_computed_tokens = 0  # preempted: recomputed with the same roles
        assert bm.get_computed_blocks(a) == blocks[:3]
