"""KV block bookkeeping: a free queue, reference counts and a prefix cache keyed by block hash.

The scheduler reaches the KV pool only through this class. Block ids index the runner's pool tensors;
nothing here touches torch.

    block table of a request (B = 4):
    tokens  | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .. .. |
    blocks  |    id 7     |    id 2     |    id 9     |   <- last block partly full, not hashed
    hash    | h(-, t0..3) | h(h7, t4..7)|     -       |

With key_by_role (the engine's way), a block's KV also depends on which of its tokens were prompt tokens, so that
count joins the hash: h(parent, tokens, num_prompt_tokens). A prompt token's row runs prefill attention (and, where a
layer has one, its prompt GEMM scheme: QuantLinear's prompt rows), a generated token's decode attention, and the two
round differently with every weight format. A request whose prompt holds another's generated tokens (the next turn
of a chat) then misses those blocks and computes them as prompt tokens, as it would alone.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from cpuserve.engine.request import Request


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    num_prompt_tokens: int | None = None  # of token_ids, when the manager keys blocks by role


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, key_by_role: bool = False):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.key_by_role = key_by_role
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the front is reused first. An OrderedDict gives O(1) removal
        # of a cached block that gets hit again while free.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.num_hits = 0
        self.num_queries = 0
        # told of each block this manager hashes, with the block before it in its request (the speculative
        # drafter's n-gram index, engine/spec/block_index.py); None: nobody listens
        self.on_cached: Callable[[Block, Block | None], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Longest chain of cached full blocks that prefixes the request (at least one token left to compute)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent: int | None = None
        max_blocks = (request.num_tokens - 1) // self.block_size
        for i in range(max_blocks):
            tokens, num_prompt = self._content(request, i)
            block_hash = self._hash(parent, tokens, num_prompt)
            block_id = self.hash_to_block.get(block_hash)
            block = self.blocks[block_id] if block_id is not None else None
            if block is None or (block.token_ids, block.num_prompt_tokens) != (tokens, num_prompt):  # hashes collide
                break
            hits.append(block_id)
            parent = block_hash
        self.num_queries += max_blocks
        self.num_hits += len(hits)
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Make the request's block table cover its computed tokens plus `num_new_tokens`.

        Returns False, changing nothing, when the pool cannot supply the blocks: the caller preempts.
        """
        # cache hits whose ref count is 0 sit in the free queue: taking them uses up free blocks too
        num_hit_free = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        num_have = len(request.block_ids) + len(computed_blocks)
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_needed = max(0, self.num_blocks_for(num_tokens) - num_have)
        if num_needed + num_hit_free > self.num_free_blocks:
            return False
        for block_id in computed_blocks:
            self._take(block_id)
        request.block_ids.extend(computed_blocks)
        request.num_hashed_blocks += len(computed_blocks)  # prefix-cache hits are hashed already
        for _ in range(num_needed):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict_hash(block_id)
            self.blocks[block_id].ref_count = 1
            request.block_ids.append(block_id)
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks; its tail goes to the front of the queue so tails are evicted first."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue[block_id] = None
                    self.free_queue.move_to_end(block_id, last=False)  # holds nothing reusable: reuse first
                else:
                    self.free_queue[block_id] = None
        request.block_ids.clear()
        request.num_hashed_blocks = 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (benchmarks: runs that must not draft or reuse an earlier run's
        text); returns how many were forgotten."""
        dropped = [b.block_id for b in self.blocks if b.ref_count == 0 and b.block_hash is not None]
        for block_id in dropped:
            self._evict_hash(block_id)
        return len(dropped)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Release the blocks of the request's table past the first num_tokens tokens (a rejected draft's blocks).

        They hold no hashed block (only computed tokens are hashed) and go to the front of the free queue."""
        keep = self.num_blocks_for(num_tokens)
        for block_id in reversed(request.block_ids[keep:]):
            block = self.blocks[block_id]
            assert block.block_hash is None, f"block {block_id} past {num_tokens} tokens is hashed"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                self.free_queue.move_to_end(block_id, last=False)
        del request.block_ids[keep:]

    def cache_full_blocks(self, request: Request) -> None:
        """Register the hashes of blocks that became full with computed tokens since the last call.

        Only those are hashed (request.num_hashed_blocks counts the rest), so a step costs O(new blocks), not
        O(every full block of every running request)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        start = request.num_hashed_blocks
        if num_full <= start:
            return
        parent = self.blocks[request.block_ids[start - 1]].block_hash if start else None
        for i in range(start, num_full):
            block = self.blocks[request.block_ids[i]]
            tokens, num_prompt = self._content(request, i)
            if block.block_hash is None:
                block.block_hash = self._hash(parent, tokens, num_prompt)
                block.token_ids, block.num_prompt_tokens = tokens, num_prompt
                self.hash_to_block.setdefault(block.block_hash, block.block_id)
                if self.on_cached is not None:
                    self.on_cached(block, self.blocks[request.block_ids[i - 1]] if i else None)
            parent = block.block_hash
        request.num_hashed_blocks = num_full

    def _content(self, request: Request, i: int) -> tuple[tuple[int, ...], int | None]:
        """Block i's tokens and, with key_by_role, how many of them are prompt tokens (else None)."""
        start = i * self.block_size
        tokens = tuple(request.all_token_ids[start:start + self.block_size])
        if not self.key_by_role:
            return tokens, None
        return tokens, min(max(request.num_prompt_tokens - start, 0), self.block_size)

    @staticmethod
    def _hash(parent: int | None, tokens: tuple[int, ...], num_prompt: int | None) -> int:
        return hash((parent, tokens)) if num_prompt is None else hash((parent, tokens, num_prompt))

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _evict_hash(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None and self.hash_to_block.get(block.block_hash) == block_id:
            del self.hash_to_block[block.block_hash]
        block.block_hash = None
        block.token_ids, block.num_prompt_tokens = (), None
