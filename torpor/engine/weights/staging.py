"""The fast path of `loader.load_weights`: checkpoint bytes -> reused host staging buffers -> parameters.

The plan (loader.plan_checkpoint) says which elements of which checkpoint tensor go to which parameter
view. Here every copy becomes byte ranges ("pieces") of its file; a contiguous copy is split into pieces
of at most one buffer, so a 1.2 GB embedding streams through 32 MiB buffers. Pieces are packed in file
order into batches (one `preadv` of one contiguous file range each). Up to `count` batches are read at
once by a thread pool (reads release the GIL) into the `count` staging buffers, while the engine's
stream copies finished batches into the parameters asynchronously (`copy_(non_blocking=True)` from
pinned memory is a `cudaMemcpyAsync`); a buffer is refilled once the event recorded after its copies
completed. Each copy is still `dst.copy_(src)` with `src` the same elements of the same bytes as
`safe_open` would give, so the result is bit-identical to the plain loader (dtype conversion included).

On CPU the same code runs with plain (pageable) buffers and synchronous copies.
Tensor-parallel ranks read only the byte ranges of their slices when those are contiguous (row slices);
column slices of row-parallel layers read the enclosing range.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from torpor.engine.weights.index import CheckpointError, PlannedCopy, TensorEntry
from torpor.memory.cuda_driver import CudaDriverError
from torpor.memory.host_buffer import HostBuffer

logger = logging.getLogger("torpor.engine")

# CUDA: 32 x 32 MiB pinned (1 GiB), kept (pinning costs ~50 ms per GiB); reader threads: min(32, usable cores). The best
# of the H200 sweep (bench sleep's STAGING_SWEEP, qwen3-8b, page cache warm, docs/weights.md): 30.1 GB/s with 16
# threads, 8 x 128 MiB (8 threads) 23-25.5 GB/s.
BUFFER_BYTES = 32 << 20
BUFFER_COUNT = 32
CPU_BUFFER_BYTES = 32 << 20  # CPU: 4 x 32 MiB plain memory per load (fresh pages cost a fault each)
CPU_BUFFER_COUNT = 4
MAX_GAP_BYTES = 1 << 20  # bytes not needed between two pieces that a batch reads through rather than split
_ALIGN = 64


@dataclass
class Piece:
    """Bytes [start, start + nbytes) of `file` go to `dst` (for a split contiguous copy: a flat range of
    elements of it). `src` views them: (dtype, shape, stride, element offset within the piece)."""

    file: Path
    start: int
    nbytes: int
    dst: torch.Tensor
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # elements from the piece's first byte to the view's first element


@dataclass
class Batch:
    file: Path
    start: int
    end: int
    pieces: list[Piece] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def usable_cpus() -> int:
    """The cores this process may run on (its affinity: a container's CPU set), not the host's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class StagingBuffers:
    """Reused host buffers for loading: registered pinned memory for a CUDA device (the memory layer's
    `HostBuffer`), plain anonymous memory on CPU. Grown on demand, freed by `close`."""

    def __init__(self, device: torch.device | str, buffer_bytes: int | None = None, count: int | None = None,
                 threads: int | None = None, keep: bool | None = None) -> None:
        """`keep`: hold the buffers between loads (default: on CUDA, where pinning them costs time; on
        CPU they are plain memory, given back after each load so they do not add to the resident set)."""
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        self.keep = on_gpu if keep is None else keep
        self.buffer_bytes = buffer_bytes or (BUFFER_BYTES if on_gpu else CPU_BUFFER_BYTES)
        self.count = count or (BUFFER_COUNT if on_gpu else CPU_BUFFER_COUNT)
        self.threads_given = bool(threads)  # EngineConfig.load_threads: used as given, beside the start-up too
        self.threads = threads or max(1, min(self.count, usable_cpus()))
        self.kind = "pinned" if self.device.type == "cuda" else "pageable"
        self.buffers: list[HostBuffer] = []
        self._prefetch: threading.Thread | None = None

    def prefetch(self, load_bytes: int) -> None:
        """Allocate (pin, on CUDA) on a thread of its own, now, the buffers a load of `load_bytes` will take, so
        the first load does not wait for them: pinning the default 1 GiB takes 0.3-0.5 s on an H200 host, which a
        start-up spends building the memory manager and the model meanwhile. Only for buffers that are kept."""
        if not self.keep or self.buffers or self._prefetch is not None or load_bytes <= 0:
            return
        count = max(1, min(self.count, -(-load_bytes // self.buffer_bytes)))
        nbytes = self.buffer_bytes + _ALIGN  # what a load of several batches asks for (a full batch + alignment)
        device = self.device

        def allocate() -> None:
            try:
                if device.type == "cuda":
                    from torpor.memory.cuda_driver import make_primary_context_current  # cuda-bindings: CUDA only

                    make_primary_context_current(device.index or 0)  # a new thread has no current context
                buffers = [self._allocate(nbytes) for _ in range(count)]
            except Exception as e:  # the load allocates what it needs itself
                logger.warning("loader: staging buffers not allocated ahead (%s)", e)
                return
            self.buffers = buffers

        self._prefetch = threading.Thread(target=allocate, name="torpor-staging-prefetch", daemon=True)
        self._prefetch.start()

    def _wait_prefetch(self) -> None:
        if self._prefetch is not None:
            self._prefetch.join()
            self._prefetch = None

    def take(self, count: int, nbytes: int) -> list[HostBuffer]:
        """`count` buffers of at least `nbytes` each (kept for the next load)."""
        self._wait_prefetch()
        if self.buffers and self.buffers[0].size < nbytes:
            self.close()
        while len(self.buffers) < count:
            self.buffers.append(self._allocate(max(nbytes, _ALIGN)))
        return self.buffers[:count]

    def _allocate(self, nbytes: int) -> HostBuffer:
        """Pinned where asked; plain memory when the host refuses to pin it (the copies are then staged
        by the driver and synchronous: slower, equally correct, since a copy from pageable memory returns
        only once the driver has taken the bytes)."""
        if self.kind == "pinned":
            try:
                return HostBuffer.allocate(nbytes, "pinned")
            except (MemoryError, ImportError, CudaDriverError) as e:
                logger.warning("loader: no pinned staging memory (%s); using pageable buffers", e)
        return HostBuffer.allocate(nbytes, "pageable")

    def close(self) -> None:
        self._wait_prefetch()
        for buffer in self.buffers:
            buffer.free()
        self.buffers = []

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self.buffers)


@dataclass
class StagedReads:
    """A load's batches (file ranges, in file order) and the staging buffers they go through, taken (pinned on
    first use) before any byte is read: `prepare_reads`, then `copy_reads`."""

    entries: Sequence[TensorEntry]
    batches: list[Batch]
    buffers: list[HostBuffer]


def prepare_reads(entries: Sequence[TensorEntry], copies: Sequence[PlannedCopy],
                  staging: StagingBuffers) -> StagedReads:
    """The planned copies as batches of file ranges, and the staging buffers for them (pinning new ones: a driver
    call the start-up makes before a capture may run beside the copies, see background_load.py)."""
    by_name = {e.name: e for e in entries}
    pieces = [p for c in copies for p in _pieces(by_name[c.name], c, staging.buffer_bytes)]
    batches = _batches(pieces, staging.buffer_bytes)
    if not batches:
        return StagedReads(entries, [], [])
    count = min(staging.count, len(batches))
    buffers = staging.take(count, max(staging.buffer_bytes if len(batches) > 1 else 0,
                                      max(b.nbytes for b in batches) + _ALIGN))
    return StagedReads(entries, batches, buffers)


def copy_planned(entries: Sequence[TensorEntry], copies: Sequence[PlannedCopy], staging: StagingBuffers) -> int:
    """Write every planned copy from the checkpoint files; returns the bytes read."""
    return copy_reads(prepare_reads(entries, copies, staging), staging)


def copy_reads(reads: StagedReads, staging: StagingBuffers, threads: int | None = None) -> int:
    """Read every batch of `reads` into its staging buffer and copy it on (the current stream on CUDA); returns
    the bytes read. `threads`: reader threads (default `staging.threads`). On CUDA the stream is synchronized
    before returning (also on error)."""
    entries, batches, buffers = reads.entries, reads.batches, reads.buffers
    if not batches:
        return 0
    count = len(buffers)
    views = [_as_bytes(b) for b in buffers]
    on_gpu = staging.device.type == "cuda"
    events: list[torch.cuda.Event | None] = [None] * count
    fds = {f: os.open(f, os.O_RDONLY) for f in {b.file for b in batches}}
    labels = {e.file: e.label for e in entries}

    def read(i: int) -> None:
        slot = i % count
        if events[slot] is not None:
            events[slot].synchronize()  # the copies out of this buffer are done
        batch = batches[i]
        _read_exactly(fds[batch.file], views[slot], batch.start % _ALIGN, batch, labels[batch.file])

    pool = ThreadPoolExecutor(min(threads or staging.threads, count), thread_name_prefix="torpor-load")
    futures = {}
    try:
        futures.update({i: pool.submit(read, i) for i in range(count)})
        with torch.no_grad():
            for i, batch in enumerate(batches):
                futures.pop(i).result()
                slot = i % count
                for piece in batch.pieces:
                    _copy_piece(piece, views[slot], batch.start - batch.start % _ALIGN, on_gpu)
                if on_gpu:
                    events[slot] = torch.cuda.Event()
                    events[slot].record()
                if i + count < len(batches):
                    futures[i + count] = pool.submit(read, i + count)
    finally:
        for future in futures.values():
            future.cancel()
        pool.shutdown(wait=True)
        if on_gpu:
            # Copies still reading the buffers finish before anything refills or frees them (also on error).
            torch.cuda.current_stream().synchronize()
        for fd in fds.values():
            os.close(fd)
        if not staging.keep:
            staging.close()
    return sum(b.nbytes for b in batches)


def _pieces(entry: TensorEntry, copy: PlannedCopy, max_bytes: int) -> list[Piece]:
    """The byte ranges of `entry` that `copy` needs; a contiguous copy split into pieces of <= max_bytes."""
    src, dst, size = copy.src, copy.dst, entry.dtype.itemsize
    if src.numel() == 0:
        return []
    if src.is_contiguous() and dst.is_contiguous():
        n, first = src.numel(), src.storage_offset()
        step = max(1, max_bytes // size)
        flat = dst.view(-1)
        return [Piece(entry.file, entry.start + (first + a) * size, min(step, n - a) * size,
                      flat[a : a + step], entry.dtype, (min(step, n - a),), (1,), 0)
                for a in range(0, n, step)]
    # A strided view (a column slice): read the enclosing range of groups of rows, each group viewed
    # with the same strides (so no group needs more than one buffer unless a single row does).
    rows = max(1, max_bytes // max(1, src.stride(0) * size)) if src.dim() else 1
    pieces = []
    for first in range(0, src.shape[0] if src.dim() else 1, rows):
        part = src.narrow(0, first, min(rows, src.shape[0] - first)) if src.dim() else src
        span = 1 + sum((d - 1) * s for d, s in zip(part.shape, part.stride(), strict=True))
        pieces.append(Piece(entry.file, entry.start + part.storage_offset() * size, span * size,
                            dst.narrow(0, first, part.shape[0]) if src.dim() else dst, entry.dtype,
                            tuple(part.shape), tuple(part.stride()), 0))
    return pieces


def _batches(pieces: list[Piece], max_bytes: int) -> list[Batch]:
    """Pieces in file order, packed into contiguous file ranges of at most max_bytes (a larger piece,
    a strided one, gets a batch of its own)."""
    batches: list[Batch] = []
    for piece in sorted(pieces, key=lambda p: (str(p.file), p.start)):
        last = batches[-1] if batches else None
        end = piece.start + piece.nbytes
        if (last is not None and last.file == piece.file and 0 <= piece.start - last.end <= MAX_GAP_BYTES
                and end - last.start + _ALIGN <= max_bytes):
            last.end = max(last.end, end)
        else:
            last = Batch(piece.file, piece.start, end)
            batches.append(last)
        last.pieces.append(piece)
    return batches


def _as_bytes(buffer: HostBuffer) -> torch.Tensor:
    """A uint8 CPU tensor over the buffer's memory (no copy)."""
    return torch.frombuffer((ctypes.c_uint8 * buffer.size).from_address(buffer.ptr), dtype=torch.uint8)


def _read_exactly(fd: int, view: torch.Tensor, at: int, batch: Batch, label: str) -> None:
    """File bytes [batch.start, batch.end) into view[at:]; the GIL is released while reading."""
    done, total = 0, batch.nbytes
    base = view.data_ptr() + at
    while done < total:
        chunk = memoryview((ctypes.c_char * (total - done)).from_address(base + done)).cast("B")
        try:
            n = os.preadv(fd, [chunk], batch.start + done)
        except OSError as e:
            raise CheckpointError(f"{label}: read failed ({e.strerror})", weights_written=True) from None
        if n == 0:
            raise CheckpointError(f"{label}: the file ended early (it changed while loading)", weights_written=True)
        done += n


def _copy_piece(piece: Piece, view: torch.Tensor, view_base: int, on_gpu: bool) -> None:
    """dst.copy_(the piece's elements, as the checkpoint tensor's dtype, straight from the buffer)."""
    at = piece.start - view_base
    raw = view[at : at + piece.nbytes]
    if raw.data_ptr() % piece.dtype.itemsize:
        raw = raw.clone()  # an odd offset in the file: an aligned copy (never in files torpor writes)
    src = raw.view(piece.dtype).as_strided(piece.shape, piece.stride, raw.view(piece.dtype).storage_offset()
                                           + piece.offset)
    piece.dst.copy_(src, non_blocking=on_gpu)
