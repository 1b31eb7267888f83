"""Host buffers that hold device segments while they sleep.

`pinned` buffers are page-locked, so copies run at the host link's speed and asynchronously; they
are allocated once per segment and reused every cycle. Large ones (>= 64 MiB) are anonymous mmaps
backed by transparent huge pages, first touched by several threads and then registered with the
driver (`cuMemHostRegister`): ten times faster than `cuMemHostAlloc`, which zeroes and pins 4 KiB pages on
one thread (docs/memory.md, "What the GPU showed"); small ones, and any large one
whose registration fails, come from `cuMemHostAlloc`. `pageable` buffers are anonymous mmaps: no
pinned memory is used and the kernel can swap them, at the cost of slower, staged copies.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache

from torpor.memory import checkpoint, cuda_driver
from torpor.memory.cuda_driver import CudaDriverError

HOST_BACKUPS = ("pinned", "pageable")
REGISTER_MIN_BYTES = 64 << 20  # below this the huge-page alignment would cost more than pinning saves
_HUGE_PAGE = 2 << 20


@dataclass(eq=False)
class HostBuffer:
    """Host memory of `size` bytes at `ptr`. `free()` gives it back; a buffer dropped without `free()` (an
    engine that is never closed) gives it back when it is collected: its mmap must never be unmapped while
    the driver still has it registered, or the next mapping at that address fails (CUDA_ERROR_ALREADY_MAPPED
    from cuMemHostAlloc, "invalid argument" from a copy out of a pageable buffer placed there)."""

    ptr: int
    size: int
    kind: str
    _mmap: mmap.mmap | None = None
    _registered: bool = False  # pinned by cuMemHostRegister (else cuMemHostAlloc)
    _region: Prefault | None = None  # carved out of this prefaulted region (its pages go back to it)

    def __post_init__(self) -> None:
        self._finalizer = weakref.finalize(self, _release, self.ptr, self.size, self.kind, self._mmap,
                                           self._registered, self._region)
        self._finalizer.atexit = False  # at exit the process gives everything back (and may be checkpointed)

    @classmethod
    def allocate(cls, size: int, kind: str, prefault: Prefault | None = None) -> HostBuffer:
        """Raises MemoryError (or CudaDriverError) when the host has no memory for it. A large pinned buffer is
        carved out of `prefault` while it has room (only the registration is left to do)."""
        if kind == "pageable":
            m, ptr = _anonymous_map(size)
            return cls(ptr, size, kind, m)
        if size >= REGISTER_MIN_BYTES and prefault is not None:
            carved = prefault.take(size)
            if carved is not None:
                try:
                    cuda_driver.host_register(carved, size)
                except CudaDriverError:
                    with contextlib.suppress(CudaDriverError):
                        cuda_driver.host_unregister(carved)
                    prefault.give_back(carved, size)
                else:
                    return cls(carved, size, "pinned", _registered=True, _region=prefault)
        if size >= REGISTER_MIN_BYTES:
            buffer = cls._register(size)
            if buffer is not None:
                return buffer
        return cls(cuda_driver.host_alloc_pinned(size), size, kind)

    @classmethod
    def _register(cls, size: int) -> HostBuffer | None:
        """A huge-page-backed mmap, touched in parallel, then registered; None where the driver refuses."""
        check_available(size)  # touching memory the host does not have would summon the OOM killer
        m, base = _anonymous_map(size + _HUGE_PAGE)
        ptr = -(-base // _HUGE_PAGE) * _HUGE_PAGE  # 2 MiB aligned, so every page can be a huge one
        if hasattr(mmap, "MADV_HUGEPAGE"):
            m.madvise(mmap.MADV_HUGEPAGE)
        _touch(ptr, size)
        try:
            cuda_driver.host_register(ptr, size)
        except CudaDriverError:
            with contextlib.suppress(CudaDriverError):  # never leave the driver a registration of unmapped memory
                cuda_driver.host_unregister(ptr)
            m.close()
            return None
        return cls(ptr, size, "pinned", m, _registered=True)

    def free(self) -> None:
        self._finalizer.detach()
        _release(self.ptr, self.size, self.kind, self._mmap, self._registered, self._region)
        self.ptr = 0


_KEPT: list[object] = []  # registered memory collected while the context was checkpointed: never unmapped


def _release(ptr: int, size: int, kind: str, m: mmap.mmap | None, registered: bool, region: Prefault | None) -> None:
    """Unpin (unregister, or free what cuMemHostAlloc gave), then unmap: in that order. While the CUDA context
    is checkpointed no driver call may be made: pinned memory is then kept (a leak, not a stale mapping)."""
    if kind == "pinned" and checkpoint.is_checkpointed():
        if m is not None or region is not None:
            _KEPT.append(m if m is not None else region)
        return
    if kind == "pinned" and not registered:
        cuda_driver.host_free_pinned(ptr)
        return
    if registered:
        cuda_driver.host_unregister(ptr)
    if region is not None:
        region.give_back(ptr, size)
    else:
        m.close()


def check_available(size: int) -> None:
    """MemoryError if the host's available memory (MemAvailable) is smaller than `size` bytes."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return  # not Linux: cuMemHostRegister or the touch reports it
    if size > available:
        raise MemoryError(f"{size / 2**20:.0f} MiB of pinned memory asked for, {available / 2**20:.0f} MiB available")


def _anonymous_map(size: int) -> tuple[mmap.mmap, int]:
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anchor = ctypes.c_char.from_buffer(m)
    ptr = ctypes.addressof(anchor)
    del anchor  # drop the buffer export so the mmap can be closed later
    return m, ptr


_TOUCH_THREADS = min(16, os.cpu_count() or 1)
BACKGROUND_TOUCH_THREADS = 2  # pinning for later (HostReservation): leave the cores to the start-up it runs beside
_background = threading.local()


@cache
def _touch_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_TOUCH_THREADS, thread_name_prefix="torpor-pin")


@contextlib.contextmanager
def in_background() -> Iterator[None]:
    """Within (on this thread): buffers are pinned by BACKGROUND_TOUCH_THREADS threads, not one per core,
    so that pinning ahead of time does not take the CPU from the work it runs beside."""
    _background.on = True
    try:
        yield
    finally:
        _background.on = False


def _touch(ptr: int, size: int) -> None:
    """Fault the pages in from several threads (ctypes.memset releases the GIL): the kernel zeroes
    each new page, and one thread does that at ~5 GiB/s."""
    threads = min(BACKGROUND_TOUCH_THREADS, _TOUCH_THREADS) if getattr(_background, "on", False) else _TOUCH_THREADS
    step = -(-size // (threads * _HUGE_PAGE)) * _HUGE_PAGE
    starts = range(0, size, step)  # `threads` pieces: no more than that run at once
    list(_touch_pool().map(lambda start: ctypes.memset(ptr + start, 0, min(step, size - start)), starts))


_PIECE = 64 << 20  # a prefault's unit of faulting in
_UNTOUCHED, _TOUCHING, _TOUCHED = 0, 1, 2
PREFAULT_WAIT_S = 60.0  # a piece another thread faults in takes ~15 ms: this long means the host is stuck


class Prefault:
    """Host memory faulted in ahead of pinning, for the large pinned buffers to come.

    Pinning a buffer is two steps of about equal cost: faulting its pages in (the kernel zeroes each one) and
    registering them with the driver (docs/benchmarks.md, "What pinning costs"). The first needs no driver call
    and no lock of the engine's, so it can run beside the start-up on a few threads; a buffer carved out of the
    region later pays only the registration. One anonymous huge-page mapping of `size` bytes, faulted in 64 MiB
    pieces in address order by `threads` background threads. `take(size)` carves the next range (2 MiB aligned),
    faulting in itself, on every core, whatever of it the background has not reached; `give_back` returns a range's
    pages to the kernel; `close()` stops the background, gives back what was never taken, and the mapping goes
    once every range taken is back. Raises MemoryError when the host's available memory is smaller than `size`."""

    def __init__(self, size: int, threads: int = BACKGROUND_TOUCH_THREADS) -> None:
        check_available(size)
        self.size = -(-size // _HUGE_PAGE) * _HUGE_PAGE
        self._map, base = _anonymous_map(self.size + _HUGE_PAGE)
        self.base = -(-base // _HUGE_PAGE) * _HUGE_PAGE
        self._map_start = base
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self._state = [_UNTOUCHED] * -(-self.size // _PIECE)
        self._changed = threading.Condition()
        self._taken = 0  # bytes carved from the start
        self._live = 0  # ranges taken and not given back
        self._closed = False
        self.touched_bytes = 0
        self._threads = [threading.Thread(target=self._fault_in, name="torpor-prefault", daemon=True)
                         for _ in range(max(1, threads))]
        for thread in self._threads:
            thread.start()

    def _claim(self, first: int, last: int) -> int | None:
        """The first untouched piece in [first, last), now marked as being touched (call with the lock held)."""
        for i in range(first, last):
            if self._state[i] == _UNTOUCHED:
                self._state[i] = _TOUCHING
                return i
        return None

    def _touch_piece(self, i: int) -> None:
        start = i * _PIECE
        size = min(_PIECE, self.size - start)
        ctypes.memset(self.base + start, 0, size)
        with self._changed:
            self._state[i] = _TOUCHED
            self.touched_bytes += size
            self._changed.notify_all()

    def _fault_in(self) -> None:
        while True:
            with self._changed:
                i = None if self._closed else self._claim(self._taken // _PIECE, len(self._state))
            if i is None:
                return
            self._touch_piece(i)

    def take(self, size: int) -> int | None:
        """The address of `size` bytes of faulted-in memory; None when the region has no room left (or is closed)."""
        need = -(-size // _HUGE_PAGE) * _HUGE_PAGE
        with self._changed:
            if self._closed or self._taken + need > self.size:
                return None
            start, self._taken = self._taken, self._taken + need
            self._live += 1
            first, last = start // _PIECE, -(-(start + size) // _PIECE)
            mine = []
            while (i := self._claim(first, last)) is not None:
                mine.append(i)
        if getattr(_background, "on", False):  # pinning ahead of time (HostReservation): this thread only
            for i in mine:
                self._touch_piece(i)
        else:
            list(_touch_pool().map(self._touch_piece, mine))
        with self._changed:
            if not self._changed.wait_for(lambda: all(self._state[i] == _TOUCHED for i in range(first, last)),
                                          PREFAULT_WAIT_S):
                self._live -= 1  # (the range stays unused: a piece of it may still be written)
                raise MemoryError(f"faulting in {size / 2**20:.0f} MiB of host memory did not end within "
                                  f"{PREFAULT_WAIT_S:.0f} s")
        return self.base + start

    def give_back(self, ptr: int, size: int) -> None:
        """Return the pages of a range `take` gave (unregistered first) to the kernel."""
        need = -(-size // _HUGE_PAGE) * _HUGE_PAGE
        self._map.madvise(mmap.MADV_DONTNEED, ptr - self._map_start, need)
        with self._changed:
            self._live -= 1
            unmap = self._closed and self._live == 0
        if unmap:
            self._map.close()

    def close(self) -> None:
        """Stop faulting in, give back what was never taken; the mapping goes when the last range taken is back."""
        with self._changed:
            if self._closed:
                return
            self._closed = True
        for thread in self._threads:
            thread.join()
        if self._taken < self.size:
            self._map.madvise(mmap.MADV_DONTNEED, self.base + self._taken - self._map_start, self.size - self._taken)
        with self._changed:
            unmap = self._live == 0
        if unmap:
            self._map.close()
