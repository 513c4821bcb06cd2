"""An n-gram index over the token blocks the prefix cache holds, so one request can draft text another one sent.

The block manager tells it of every block it hashes (BlockManager.on_cached). For each n in [n_min, n_max] and each
position o of the block, the n tokens before o (reaching into the parent block's tail when o < n) map to where the
text continued: (block id, o). A draft reads the block from o on and, past its end, the child block that was cached
after it (llama.cpp's ngram-mod keeps one hash pool of next tokens shared by all slots; this keeps positions, so a
hit yields k tokens at once).

    parent block        block b (B = 4)      child of b
    | .. x  y |         | z  w  u  v |       | s  t .. .. |
          (x, y) -> (b, 0)    draft from there: z w u v s t ...
             (y, z) -> (b, 1) ...

Entries are plain ints (key: hash of the n-gram; value: block_id * B + o), checked when read: the block must still
be hashed and, where the n-gram lies inside it, hold those tokens. A stale or colliding entry only makes a bad
draft, which verification rejects; correctness never depends on this index. Evicted blocks leave entries behind,
so the index is rebuilt from the blocks still cached when it grows past `max_entries`.
"""

from __future__ import annotations

from typing import Sequence


class BlockIndex:
    def __init__(self, blocks: Sequence, block_size: int, n_min: int, n_max: int, max_entries: int):
        self.blocks = blocks  # the block manager's Block list (block_hash, token_ids), read only
        self.block_size = block_size
        self.n_min, self.n_max = n_min, n_max
        self.max_entries = max_entries
        self.entries: dict[int, int] = {}
        # parent block id -> (parent's hash, child block id, child's hash): the block cached right after it
        self.children: dict[int, tuple[int, int, int]] = {}

    def add(self, block, parent) -> None:
        """Index a block that was just hashed; parent: the block before it in its request, or None."""
        if len(self.entries) > self.max_entries:
            self._rebuild()
        tail = parent.token_ids[-self.n_max:] if parent is not None and parent.block_hash is not None else ()
        self._index(block, tail)
        if tail:
            self.children[parent.block_id] = (parent.block_hash, block.block_id, block.block_hash)

    def lookup(self, suffix: Sequence[int], max_tokens: int) -> list[int]:
        """Up to max_tokens tokens that followed `suffix` (one n-gram) in a cached block; [] when none did."""
        value = self.entries.get(hash(tuple(suffix)))
        if value is None:
            return []
        block_id, offset = divmod(value, self.block_size)
        block = self.blocks[block_id]
        n = len(suffix)
        if block.block_hash is None or (offset >= n and tuple(block.token_ids[offset - n:offset]) != tuple(suffix)):
            return []  # evicted, reused, or a hash collision
        draft = list(block.token_ids[offset:offset + max_tokens])
        while len(draft) < max_tokens and (child := self._child(block)) is not None:
            block = child
            draft += block.token_ids[:max_tokens - len(draft)]
        return draft

    def _child(self, block):
        link = self.children.get(block.block_id)
        if link is None or link[0] != block.block_hash:
            return None
        child = self.blocks[link[1]]
        return child if child.block_hash == link[2] else None

    def _index(self, block, tail: Sequence[int]) -> None:
        context = (*tail, *block.token_ids)
        base = len(tail)
        value = block.block_id * self.block_size
        for offset in range(len(block.token_ids)):
            end = base + offset
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.entries[hash(context[end - n:end])] = value + offset

    def _rebuild(self) -> None:
        """Drop every entry and index the blocks still cached again, each on its own (no parent tails)."""
        self.entries.clear()
        self.children = {k: v for k, v in self.children.items() if self.blocks[k].block_hash == v[0]}
        for block in self.blocks:
            if block.block_hash is not None:
                self._index(block, ())
