"""Paged KV-cache block allocator with reference counts and automatic prefix caching (torch-free).

Blocks are plain ids into the KV cache tensors; a token at position p of a sequence lives in
block `seq.block_table[p // block_size]` at offset `p % block_size`.

Sharing. A block may sit in several block tables (the n samples of one request share their prompt's
full blocks; requests with a common prefix share its blocks); it is free once no table holds it.

Prefix caching (`enable_prefix_caching`). A full block is known by its key, SHA-256 of (parent key, its
token ids), so equal keys mean equal prefixes. (Python's hash() is not collision-resistant: a prompt can be
crafted whose block's key equals another prefix's, and comparing a hit's token ids and parent key does not
catch a collision of the parent keys, so another prefix's next block would be served.) A block is registered
under its key as soon as the step that writes it is scheduled (a later sequence of the same prefill batch
may then use it: each layer stores every new K/V before any attention reads the cache). Free blocks keep
their keys and stay findable until the allocator reuses them, least recently freed first (a freed sequence's
blocks are freed tail first, so its prefix outlives its tail). Full blocks are never written again, so no
copy-on-write is needed. `reset_prefix_cache` forgets every key (new weights make the cached K/V stale).

Determinism: with a deterministic free list and `reset()` after every discard of the cache, the same
requests always get the same blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from torpor.engine.sequence import Sequence

_ROOT_KEY = b""  # the parent key of a sequence's first block


class BlockManager:
    """Hands out KV-cache blocks to sequences; frees a block when its last holder lets go."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.epoch = 0           # bumped by reset_prefix_cache: older sequences register nothing more
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache (counters, never reset)
        self.num_hit_tokens = 0      # of those, tokens found
        self.reset()

    def reset(self) -> None:
        """Forget every allocation and every cached block (the KV cache was discarded): all blocks free,
        in id order. Sequences that still hold blocks must have been preempted or finished by the caller."""
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_blocks))  # oldest first
        # Which sequences hold each block: its reference count, and a check against double or stale frees. None
        # for a block nobody holds: a set per block would make a wake of a large cache (46k blocks) build 46k
        # objects, and every later full garbage collection walk them.
        self._holders: list[set[tuple[str, int]] | None] = [None] * self.num_blocks
        self._forget_keys()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (their K/V may be stale); blocks in use stay with their holders."""
        self._forget_keys()
        self.epoch += 1

    def _forget_keys(self) -> None:
        self._cached: dict[bytes, int] = {}                          # key -> block id
        self._block_id_key: list[tuple[bytes, bytes, tuple[int, ...]] | None] = [None] * self.num_blocks

    # ---- accounting ----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached ones among them: reusable, evicted when taken)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return len(self._holders[block_id] or ())

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # ---- prefill -------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_forks: int = 0, use_cache: bool = True) -> bool:
        """Whether `seq` (and `num_forks` samples forked from it) fit in free blocks right now."""
        return self._blocks_needed(seq, num_forks, self._cache_hits(seq, use_cache)) <= len(self._free)

    def num_hit_tokens_for(self, seq: Sequence, use_cache: bool = True) -> int:
        """Tokens of `seq` the prefix cache would give it now."""
        return len(self._cache_hits(seq, use_cache)) * self.block_size

    def allocate(self, seq: Sequence, use_cache: bool = True) -> None:
        """Give `seq` (holding no blocks) the blocks for all its tokens: cached ones for the longest cached
        prefix of whole blocks (then `seq.num_cached_tokens` covers them; at least its last token is left
        to compute), new ones for the rest. `use_cache=False` takes no cached blocks (e.g. prompt logprobs
        must see every prompt position); its blocks are still registered for others."""
        if seq.block_table:
            raise RuntimeError(f"{seq.request_id!r} already holds {len(seq.block_table)} blocks")
        hits = self._cache_hits(seq, use_cache)
        needed = self._blocks_needed(seq, 0, hits)
        if needed > len(self._free):
            raise RuntimeError(f"{seq.request_id!r} needs {needed} KV blocks, only "
                               f"{len(self._free)} of {self.num_blocks} are free")
        for block_id in hits:
            self._hold(block_id, seq)
        seq.block_table = hits + [self._take(seq) for _ in range(self.num_blocks_for(len(seq)) - len(hits))]
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)
        seq.cache_epoch = self.epoch
        if self.enable_prefix_caching and seq.num_output_tokens == 0:
            seq.num_prefix_cached_tokens = seq.num_cached_tokens
            self.num_queried_tokens += len(seq)
            self.num_hit_tokens += seq.num_cached_tokens
        self._register_full_blocks(seq)

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Share `parent`'s prompt blocks with `child` (a fresh sample of the same request, prefilled in this
        step): the full blocks by reference; the partial last block, which the samples will fill
        differently, as a new block of the child's. Returns (parent's block, child's block) to copy once
        the step has written the prompt's K/V, or None when the prompt ends on a block boundary."""
        if child.block_table or parent.num_output_tokens or child.num_output_tokens:
            raise RuntimeError(f"fork of {child.seq_id}: both must be fresh, the child hold no blocks")
        num_full = len(parent) // self.block_size
        partial = len(parent.block_table) > num_full
        if partial and not self._free:
            raise RuntimeError(f"fork of {child.seq_id}: no free KV block for its last prompt block")
        for block_id in parent.block_table[:num_full]:
            self._hold(block_id, child)
        child.block_table = parent.block_table[:num_full]
        child.block_keys = list(parent.block_keys)
        child.num_registered_blocks, child.cache_epoch = num_full, parent.cache_epoch
        child.num_prefix_cached_tokens = parent.num_prefix_cached_tokens
        if self.enable_prefix_caching:  # the child computes none of its prompt
            self.num_queried_tokens += len(child)
            self.num_hit_tokens += len(child)
        if not partial:
            return None
        child.block_table.append(self._take(child))
        return parent.block_table[-1], child.block_table[-1]

    def _cache_hits(self, seq: Sequence, use_cache: bool) -> list[int]:
        """The cached blocks of `seq`'s longest cached prefix of whole blocks, leaving >= 1 token to compute."""
        if not (self.enable_prefix_caching and use_cache):
            return []
        hits = []
        for j, key in enumerate(self._keys(seq)[: (len(seq) - 1) // self.block_size]):
            block_id = self._cached.get(key)
            if block_id is None or self._block_id_key[block_id] != (key, self._parent_key(seq, j),
                                                                    self._block_tokens(seq, j)):
                break
            hits.append(block_id)
        return hits

    def _blocks_needed(self, seq: Sequence, num_forks: int, hits: list[int]) -> int:
        """Free blocks an allocation takes: new blocks, cached blocks that are free now, a last block per fork."""
        new = self.num_blocks_for(len(seq)) - len(hits)
        revived = sum(1 for block_id in hits if not self._holders[block_id])
        forks = num_forks if len(seq) % self.block_size else 0
        return new + revived + forks

    # ---- decode --------------------------------------------------------------------------
    def can_append(self, seq: Sequence) -> bool:
        """Whether `seq` can grow to hold all its tokens (at most one new block per decode step)."""
        missing = self._missing_blocks(seq)
        return missing <= 0 or missing <= len(self._free)

    def append_all(self, seqs: list[Sequence]) -> bool:
        """`may_append` of every one of `seqs`, in order, when the free blocks suffice for all of them (True);
        else nothing (False: the caller checks them one by one and preempts). A decode step's common case in one
        pass: only the sequences whose last token crossed into a new block, or that filled a block to register,
        have anything to do (the same calls in the same order as one `may_append` per sequence)."""
        size = self.block_size
        if self.enable_prefix_caching:
            busy = [seq for seq in seqs if (n := len(seq.token_ids)) > size * len(seq.block_table)
                    or n // size > seq.num_registered_blocks]
        else:
            busy = [seq for seq in seqs if len(seq.token_ids) > size * len(seq.block_table)]
        if sum(max(self._missing_blocks(seq), 0) for seq in busy) > len(self._free):
            return False
        for seq in busy:
            self.may_append(seq)
        return True

    def may_append(self, seq: Sequence) -> None:
        """Add a block to `seq` if its last token crossed into a new block; register blocks this step fills.
        (Called for every running sequence every decode step: the common case, nothing to do, is kept cheap.)"""
        missing = self._missing_blocks(seq)
        if missing > 0:
            if missing > len(self._free):
                raise RuntimeError(f"{seq.request_id!r} needs {missing} more KV blocks, only "
                                   f"{len(self._free)} are free")
            seq.block_table.extend(self._take(seq) for _ in range(missing))
        if self.enable_prefix_caching and len(seq.token_ids) // self.block_size > seq.num_registered_blocks:
            self._register_full_blocks(seq)

    def deallocate(self, seq: Sequence) -> None:
        """Let go of `seq`'s blocks (each is freed when no other sequence holds it) and clear its cache state."""
        seq_id, holders_of, free = seq.seq_id, self._holders, self._free
        for block_id in seq.block_table:  # check all first, so a bad call changes nothing
            if seq_id not in (holders_of[block_id] or ()):
                raise RuntimeError(f"{seq.request_id!r} frees block {block_id}, which it does not hold "
                                   f"(holders: {sorted(holders_of[block_id] or ())})")
        # Tail first: the LRU order then evicts a prefix's tail before its head.
        table = reversed(seq.block_table) if self.enable_prefix_caching else seq.block_table
        for block_id in table:
            holders = holders_of[block_id]
            holders.discard(seq_id)
            if not holders:
                holders_of[block_id] = None
                free[block_id] = None
        seq.block_table = []
        seq.num_cached_tokens = 0
        seq.num_registered_blocks = 0

    def _missing_blocks(self, seq: Sequence) -> int:
        """Blocks `seq` lacks to hold its tokens (<= 0: none)."""
        return -(-len(seq.token_ids) // self.block_size) - len(seq.block_table)

    # ---- blocks and keys -----------------------------------------------------------------
    def _take(self, seq: Sequence) -> int:
        """The least recently freed block, evicted from the prefix cache if it was cached."""
        block_id, _ = self._free.popitem(last=False)
        entry = self._block_id_key[block_id]
        if entry is not None:
            self._block_id_key[block_id] = None
            if self._cached.get(entry[0]) == block_id:
                del self._cached[entry[0]]
        self._holders[block_id] = {seq.seq_id}  # a free block has no holder
        return block_id

    def _hold(self, block_id: int, seq: Sequence) -> None:
        holders = self._holders[block_id]
        if not holders:
            del self._free[block_id]  # a cached free block comes back into use
            self._holders[block_id] = {seq.seq_id}
        else:
            holders.add(seq.seq_id)

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that are full once the scheduled step has run."""
        if not self.enable_prefix_caching or seq.cache_epoch != self.epoch:
            return
        keys = self._keys(seq)
        for j in range(seq.num_registered_blocks, len(seq) // self.block_size):
            block_id = seq.block_table[j]
            if keys[j] not in self._cached and self._block_id_key[block_id] is None:
                self._cached[keys[j]] = block_id
                self._block_id_key[block_id] = (keys[j], self._parent_key(seq, j), self._block_tokens(seq, j))
        seq.num_registered_blocks = len(seq) // self.block_size

    def _keys(self, seq: Sequence) -> list[bytes]:
        """Keys of `seq`'s full blocks (computed once per block: tokens are only ever appended)."""
        keys = seq.block_keys
        for j in range(len(keys), len(seq) // self.block_size):
            keys.append(block_key(self._parent_key(seq, j), self._block_tokens(seq, j)))
        return keys

    @staticmethod
    def _parent_key(seq: Sequence, j: int) -> bytes:
        return seq.block_keys[j - 1] if j else _ROOT_KEY

    def _block_tokens(self, seq: Sequence, j: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[j * self.block_size : (j + 1) * self.block_size])


def block_key(parent_key: bytes, token_ids: tuple[int, ...]) -> bytes:
    """The key of a full block: SHA-256 of its parent's key and its token ids."""
    return hashlib.sha256(parent_key + array("q", token_ids).tobytes()).digest()
