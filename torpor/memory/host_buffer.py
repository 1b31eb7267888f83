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

    def __post_init__(self) -> None:
        self._finalizer = weakref.finalize(self, _release, self.ptr, self.kind, self._mmap, self._registered)
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
        _release(self.ptr, self.kind, self._mmap, self._registered)
        self.ptr = 0


_KEPT: list[mmap.mmap] = []  # registered memory collected while the context was checkpointed: never unmapped


def _release(ptr: int, kind: str, m: mmap.mmap | None, registered: bool) -> None:
    """Unpin (unregister, or free what cuMemHostAlloc gave), then unmap: in that order. While the CUDA context
    is checkpointed no driver call may be made: pinned memory is then kept (a leak, not a stale mapping)."""
    if kind == "pinned" and checkpoint.is_checkpointed():
        if m is not None:
            _KEPT.append(m)
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
