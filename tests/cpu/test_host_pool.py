"""`HostPool` (memory layer): host memory faulted in ahead, carved into buffers in order, each buffer's pages given back
when it is freed, the untaken rest at `finish()`, the mapping closed once both happened. On CPU as plain memory
(`pageable`: no registration); the pinned form runs in every CUDA engine start-up."""

import ctypes

from torpor.memory.host_buffer import HostPool

MiB = 1 << 20


def resident_bytes(pool: HostPool, start: int, size: int) -> int:
    """Bytes of [start, start + size) of the pool that are in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = 4096
    vec = (ctypes.c_ubyte * (size // page))()
    assert libc.mincore(ctypes.c_void_p(pool.base + start), ctypes.c_size_t(size), vec) == 0
    return sum(v & 1 for v in vec) * page


def test_buffers_are_carved_in_order_from_memory_faulted_in_ahead():
    pool = HostPool(24 * MiB, kind="pageable", threads=3)
    a, b = pool.take(5 * MiB), pool.take(8 * MiB)  # rounded up to 2 MiB pages
    assert (a.ptr, a.size) == (pool.base, 6 * MiB) and (b.ptr, b.size) == (pool.base + 6 * MiB, 8 * MiB)
    assert resident_bytes(pool, 0, 24 * MiB) == 24 * MiB  # every page faulted in before any copy was made
    ctypes.memset(b.ptr, 7, b.size)
    assert ctypes.string_at(b.ptr + b.size - 1, 1) == b"\x07"
    assert pool.take(12 * MiB) is None  # beyond what is left: the caller makes a buffer of its own
    a.free()
    assert resident_bytes(pool, 0, 6 * MiB) == 0  # a freed buffer's pages go back at once
    pool.finish()
    assert resident_bytes(pool, 14 * MiB, 10 * MiB) == 0  # and the untaken rest at finish
    assert pool.take(2 * MiB) is None and pool._mmap is not None  # b still lives in it
    b.free()
    assert pool._mmap is None  # the mapping went with the last buffer


def test_a_pool_whose_buffers_are_collected_closes_too():
    pool = HostPool(4 * MiB, kind="pageable", threads=1)
    buffer = pool.take(4 * MiB)
    pool.finish()
    del buffer  # an engine dropped without close(): its copies go when collected
    assert pool._mmap is None
