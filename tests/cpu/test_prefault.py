"""Prefault: host memory faulted in ahead of pinning, carved into the first host copies (no CUDA call is made here:
the region is plain host memory until a buffer carved from it is registered)."""

from __future__ import annotations

import ctypes
import mmap
import time

import pytest

from torpor.memory.host_buffer import Prefault

MiB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)


def resident_fraction(ptr: int, size: int) -> float:
    """The fraction of the pages of [ptr, ptr + size) that are in memory (mincore)."""
    page = mmap.PAGESIZE
    start = ptr // page * page
    pages = -(-(ptr + size - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    assert _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / pages


def wait_touched(region: Prefault, nbytes: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while region.touched_bytes < nbytes:
        assert time.monotonic() < deadline, f"the background faulted in {region.touched_bytes} of {nbytes} bytes"
        time.sleep(0.01)


def test_a_taken_range_is_faulted_in_and_the_background_faults_in_the_rest():
    region = Prefault(256 * MiB, threads=1)
    try:
        ptr = region.take(100 * MiB)
        assert ptr is not None and ptr % (2 * MiB) == 0
        assert resident_fraction(ptr, 100 * MiB) == 1.0
        wait_touched(region, region.size)
        assert resident_fraction(region.base, region.size) == 1.0
    finally:
        region.close()


def test_the_background_never_writes_a_range_after_it_was_taken():
    region = Prefault(512 * MiB, threads=2)  # the background is still faulting in when the ranges are taken
    try:
        ranges = [(region.take(size), size) for size in (3 * MiB, 70 * MiB, 130 * MiB, 5 * MiB)]
        for i, (ptr, size) in enumerate(ranges):
            ctypes.memset(ptr, 0x41 + i, size)
        wait_touched(region, region.size)
        for i, (ptr, size) in enumerate(ranges):
            assert ctypes.string_at(ptr, size) == bytes([0x41 + i]) * size, f"range {i} was overwritten"
        starts = sorted(p for p, _ in ranges)
        assert all(b - a >= 3 * MiB for a, b in zip(starts, starts[1:], strict=False))  # no two ranges overlap
    finally:
        region.close()


def test_a_region_with_no_room_or_closed_takes_nothing():
    region = Prefault(128 * MiB, threads=1)
    assert region.take(100 * MiB) is not None
    assert region.take(64 * MiB) is None  # 28 MiB are left
    assert region.take(20 * MiB) is not None
    region.close()
    assert region.take(2 * MiB) is None


def test_given_back_pages_leave_memory_and_the_mapping_goes_with_the_last_range():
    region = Prefault(256 * MiB, threads=1)
    first, second = region.take(64 * MiB), region.take(64 * MiB)
    wait_touched(region, region.size)
    region.give_back(first, 64 * MiB)
    assert resident_fraction(first, 64 * MiB) == 0.0
    assert resident_fraction(second, 64 * MiB) == 1.0
    region.close()  # the 128 MiB never taken go back now; `second` is still in use
    assert resident_fraction(second + 64 * MiB, 128 * MiB) == 0.0
    assert not region._map.closed
    region.give_back(second, 64 * MiB)
    assert region._map.closed


def test_more_than_the_host_has_is_refused_before_anything_is_touched():
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    with pytest.raises(MemoryError, match="available"):
        Prefault(2 * total)
