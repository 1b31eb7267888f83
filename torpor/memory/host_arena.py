"""Host arenas: each tag's CPU tensors live in anonymous mmap chunks that never move.

A chunk is one `Segment` of the tag. Small blocks share chunks of `chunk_bytes`; a large block
gets a chunk of its own. Blocks are handed to PyTorch as ctypes arrays placed at fixed addresses
(`torch.frombuffer` keeps the array alive as long as any tensor uses the storage); a
`weakref.finalize` on that array queues the block's release. Releases are queued rather than
applied at once because the finalizer may run inside an allocation of this same arena (garbage
collection can start anywhere); the queue is drained under the lock by the next operation.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field

from torpor.memory.segments import Segment

ALIGN = 64  # bytes; what PyTorch's CPU allocator guarantees
PAGE = mmap.PAGESIZE


def _round(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(eq=False)
class HostChunk(Segment):
    mapping: mmap.mmap | None = None
    free_ranges: list[tuple[int, int]] = field(default_factory=list)  # sorted (offset, size)
    live: dict[int, int] = field(default_factory=dict)  # offset -> size of live blocks

    @classmethod
    def create(cls, size: int, tag: str) -> HostChunk:
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        anchor = ctypes.c_char.from_buffer(m)
        address = ctypes.addressof(anchor)
        del anchor  # no lasting buffer export, so the mmap can be closed
        return cls(address, size, tag, mapping=m, free_ranges=[(0, size)])

    def take(self, nbytes: int) -> int | None:
        """First fit; returns the block's offset or None."""
        for i, (off, size) in enumerate(self.free_ranges):
            if size >= nbytes:
                if size == nbytes:
                    del self.free_ranges[i]
                else:
                    self.free_ranges[i] = (off + nbytes, size - nbytes)
                self.live[off] = nbytes
                return off
        return None

    def give_back(self, offset: int) -> None:
        """Return a live block to the sorted free list, merged with its free neighbours (no full re-sort:
        freeing n small blocks in any order stays near-linear)."""
        size = self.live.pop(offset)
        ranges = self.free_ranges
        i = bisect.bisect(ranges, (offset, size))
        if i < len(ranges) and offset + size == ranges[i][0]:
            size += ranges.pop(i)[1]
        if i and ranges[i - 1][0] + ranges[i - 1][1] == offset:
            ranges[i - 1] = (ranges[i - 1][0], ranges[i - 1][1] + size)
        else:
            ranges.insert(i, (offset, size))

    @property
    def high_water(self) -> int:
        """End of the last live block: the bytes worth copying on offload."""
        return max((off + size for off, size in self.live.items()), default=0)

    @property
    def allocated(self) -> int:
        return sum(self.live.values())


class HostArena:
    """Chunk allocation for one host backend (all tags); thread-safe through the store's lock."""

    def __init__(self, store, chunk_bytes: int = 16 << 20) -> None:
        self.store = store  # the HostBackend (SegmentStore) that owns the chunks
        self.chunk_bytes = chunk_bytes
        self._released: deque[tuple[HostChunk, int]] = deque()
        self._busy = threading.local()  # set while this thread is inside an arena operation

    def allocate(self, tag: str, nbytes: int) -> ctypes.Array:
        """A block of at least `nbytes` in `tag`'s memory, as a ctypes array at its address."""
        nbytes = _round(max(nbytes, 1), ALIGN)
        with self.store.lock:
            self._busy.on = True
            try:
                self.drain()
                chunk, offset = self._place(tag, nbytes)
            finally:
                self._busy.on = False
            block = (ctypes.c_char * nbytes).from_address(chunk.address + offset)
        weakref.finalize(block, self._release, chunk, offset)
        return block

    def _release(self, chunk: HostChunk, offset: int) -> None:
        self._released.append((chunk, offset))
        if not getattr(self._busy, "on", False):
            self.drain()

    def _place(self, tag: str, nbytes: int) -> tuple[HostChunk, int]:
        if nbytes < self.chunk_bytes // 2:
            for chunk in self.store.of_tag(tag):
                if chunk.resident and chunk.size == self.chunk_bytes:
                    offset = chunk.take(nbytes)
                    if offset is not None:
                        return chunk, offset
            size = self.chunk_bytes
        else:
            size = _round(nbytes, PAGE)
        chunk = HostChunk.create(size, tag)
        self.store.add(chunk)
        self.store.on_new_segment(tag, size)
        return chunk, chunk.take(nbytes)

    def drain(self) -> None:
        """Apply queued block releases; unmap chunks left empty."""
        if getattr(self._busy, "on", False) and not self._released:
            return
        with self.store.lock:
            while self._released:
                chunk, offset = self._released.popleft()
                chunk.give_back(offset)
                if not chunk.live:
                    self.store.pop(chunk.address)
                    chunk.mapping.close()
                    if isinstance(chunk.backup, int):
                        os.close(chunk.backup)
                    chunk.backup = None
