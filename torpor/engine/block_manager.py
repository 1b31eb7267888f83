"""Paged KV-cache block allocator (torch-free).

Blocks are plain ids into the KV cache tensors; a token at position p of a sequence lives in
block `seq.block_table[p // block_size]` at offset `p % block_size`.

No prefix caching (yet): sharing blocks between requests makes a round's results depend on what
earlier rounds left in the cache, and sleep/wake rounds must be bit-exact against a cold engine.
With a deterministic free list, the same requests always get the same blocks after `reset()`.
"""

from __future__ import annotations

from collections import deque

from torpor.engine.sequence import Sequence


class BlockManager:
    """Hands out KV-cache blocks to sequences from a FIFO free list."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.reset()

    def reset(self) -> None:
        """Forget every allocation (the KV cache was discarded): all blocks free, in id order.

        Sequences that still hold blocks must have been preempted or finished by the caller.
        """
        self._free: deque[int] = deque(range(self.num_blocks))
        # Which request holds each block: catches double frees and frees of stale block tables.
        self._owner: list[str | None] = [None] * self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether all of `seq`'s tokens fit in free blocks right now."""
        return self.num_blocks_for(len(seq)) <= len(self._free)

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` (holding no blocks) the blocks for all its tokens."""
        if seq.block_table:
            raise RuntimeError(f"{seq.request_id!r} already holds {len(seq.block_table)} blocks")
        needed = self.num_blocks_for(len(seq))
        if needed > len(self._free):
            raise RuntimeError(f"{seq.request_id!r} needs {needed} KV blocks, only "
                               f"{len(self._free)} of {self.num_blocks} are free")
        seq.block_table = [self._take(seq) for _ in range(needed)]

    def can_append(self, seq: Sequence) -> bool:
        """Whether `seq` can grow to hold all its tokens (at most one new block per decode step)."""
        return self._missing_blocks(seq) <= len(self._free)

    def may_append(self, seq: Sequence) -> None:
        """Add a block to `seq` if its last token crossed into a new block."""
        missing = self._missing_blocks(seq)
        if missing > len(self._free):
            raise RuntimeError(f"{seq.request_id!r} needs {missing} more KV blocks, only "
                               f"{len(self._free)} are free")
        seq.block_table.extend(self._take(seq) for _ in range(missing))

    def deallocate(self, seq: Sequence) -> None:
        """Return `seq`'s blocks to the free list and clear its cache state."""
        for block_id in seq.block_table:  # check all first, so a bad call changes nothing
            if self._owner[block_id] != seq.request_id:
                raise RuntimeError(f"{seq.request_id!r} frees block {block_id}, which it does not hold "
                                   f"(holder: {self._owner[block_id]!r})")
        for block_id in seq.block_table:
            self._owner[block_id] = None
            self._free.append(block_id)
        seq.block_table = []
        seq.num_cached_tokens = 0

    def _missing_blocks(self, seq: Sequence) -> int:
        return max(0, self.num_blocks_for(len(seq)) - len(seq.block_table))

    def _take(self, seq: Sequence) -> int:
        block_id = self._free.popleft()
        self._owner[block_id] = seq.request_id
        return block_id
