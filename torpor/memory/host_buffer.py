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
    _pool: HostPool | None = None  # carved from a HostPool (its memory, not an mmap of its own)

    def __post_init__(self) -> None:
        self._finalizer = weakref.finalize(self, _release, self.ptr, self.kind, self._mmap, self._registered,
                                           self._pool, self.size)
        self._finalizer.atexit = False  # at exit the process gives everything back (and may be checkpointed)

    @classmethod
    def allocate(cls, size: int, kind: str) -> HostBuffer:
        """Raises MemoryError (or CudaDriverError) when the host has no memory for it."""
        if kind == "pageable":
            m, ptr = _anonymous_map(size)
            return cls(ptr, size, kind, m)
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
        _release(self.ptr, self.kind, self._mmap, self._registered, self._pool, self.size)
        self.ptr = 0


_KEPT: list = []  # registered memory (mmaps, pools) collected while the context was checkpointed: never unmapped


def _release(ptr: int, kind: str, m: mmap.mmap | None, registered: bool, pool: HostPool | None = None,
             size: int = 0) -> None:
    """Unpin (unregister, or free what cuMemHostAlloc gave), then unmap: in that order. While the CUDA context
    is checkpointed no driver call may be made: pinned memory is then kept (a leak, not a stale mapping)."""
    if kind == "pinned" and checkpoint.is_checkpointed():
        if m is not None:
            _KEPT.append(m)
        elif pool is not None:
            _KEPT.append(pool)
        return
    if pool is not None:
        if registered:
            cuda_driver.host_unregister(ptr)
        pool.give_back(ptr, size)
        return
    if kind == "pinned" and not registered:
        cuda_driver.host_free_pinned(ptr)
        return
    if registered:
        cuda_driver.host_unregister(ptr)
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
# Pinning for later (HostReservation), beside the start-up: 4 threads pin an 8B model's weights well within the
# start-up and leave the other cores to it (touch and registration speeds by thread count: docs/benchmarks.md).
BACKGROUND_TOUCH_THREADS = 4
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


class HostPool:
    """Host memory for buffers to come, faulted in ahead: one huge-page mmap of `size` bytes whose pages several
    threads touch at once on a thread of its own (the kernel's zeroing of fresh pages is the costly part of pinning),
    started before the engine's busy start-up phases (the weight load, the graph capture), which the same work beside
    them slowed by a third. `take(size)` carves the next buffer from it (registered when `pinned`, else plain
    memory); a buffer given back returns its pages to the kernel; `finish()` ends carving and gives back the pages
    never taken; the mmap goes once both happened. `take` answers None when the pool cannot serve (full, failed,
    finished, or not ready within `wait_s`): the caller makes a buffer of its own."""

    def __init__(self, size: int, kind: str = "pinned", threads: int | None = None) -> None:
        self.size = -(-size // _HUGE_PAGE) * _HUGE_PAGE
        self.kind = kind
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._next = 0
        self._live = 0
        self._finished = False
        self._ready = threading.Event()
        check_available(self.size)
        self._mmap, base = _anonymous_map(self.size + _HUGE_PAGE)
        self.base = -(-base // _HUGE_PAGE) * _HUGE_PAGE
        self._offset = self.base - base  # of the pool's first byte in the mmap
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._mmap.madvise(mmap.MADV_HUGEPAGE)
        self._thread = threading.Thread(target=self._fault, args=(threads or _TOUCH_THREADS,),
                                        name="torpor-host-pool", daemon=True)
        self._thread.start()

    def _fault(self, threads: int) -> None:
        try:
            step = -(-self.size // (threads * _HUGE_PAGE)) * _HUGE_PAGE
            starts = range(0, self.size, step)
            with ThreadPoolExecutor(len(starts), thread_name_prefix="torpor-pool-touch") as pool:
                list(pool.map(lambda start: ctypes.memset(self.base + start, 0, min(step, self.size - start)),
                              starts))
        except BaseException as exc:  # take() then answers None: buffers of their own
            self.error = exc
        self._ready.set()

    def take(self, size: int, wait_s: float = 60.0) -> HostBuffer | None:
        size = -(-size // _HUGE_PAGE) * _HUGE_PAGE
        if not self._ready.wait(wait_s) or self.error is not None:
            return None
        with self._lock:
            if self._finished or self._next + size > self.size:
                return None
            ptr = self.base + self._next
            self._next += size
            self._live += 1
        if self.kind == "pinned":
            try:
                cuda_driver.host_register(ptr, size)
            except CudaDriverError:
                with contextlib.suppress(CudaDriverError):
                    cuda_driver.host_unregister(ptr)
                self.give_back(ptr, size)
                return None
        return HostBuffer(ptr, size, self.kind, _registered=self.kind == "pinned", _pool=self)

    def give_back(self, ptr: int, size: int) -> None:
        """The pages of a buffer carved from here go back to the kernel (the buffer is unregistered already)."""
        self._drop(ptr - self.base, size)
        with self._lock:
            self._live -= 1
            self._close_if_done()

    def finish(self) -> None:
        """No more buffers from here: the pages never taken go back to the kernel now."""
        self._ready.wait()
        with self._lock:
            if self._finished:
                return
            self._finished = True
            start = self._next
        if start < self.size:
            self._drop(start, self.size - start)
        with self._lock:
            self._close_if_done()

    @property
    def taken_bytes(self) -> int:
        return self._next

    def _drop(self, start: int, size: int) -> None:
        if size > 0 and self._mmap is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._mmap.madvise(mmap.MADV_DONTNEED, self._offset + start, size)

    def _close_if_done(self) -> None:  # with the lock held
        if self._finished and self._live == 0 and self._mmap is not None:
            self._mmap.close()
            self._mmap = None
