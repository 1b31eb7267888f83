"""CUDA backend: one `torch.cuda.MemPool` per tag, backed by CUDA virtual memory.

Each tag's pool has its own pluggable allocator whose two C callbacks are ctypes function
pointers into this module. The caching allocator calls them once per *segment* (not per tensor);
`alloc` reserves an address range and maps fresh physical memory into it, `free` undoes that.
Sleep unmaps the physical memory (after an optional copy to host) and keeps the address range;
wake maps new physical memory at the same addresses. Tensors, views and captured CUDA graphs
therefore stay valid.

The GIL and the allocator lock. PyTorch releases the GIL while an op runs, so a tensor created
in a tag scope reaches the caching allocator without the GIL, takes the allocator's mutex, and
our callback then needs the GIL (ctypes takes it). Any *other* thread that holds the GIL and
waits for that mutex -- creating or entering a pool, `memory_snapshot`, `empty_cache`, freeing a
CUDA tensor from Python -- would deadlock with it. torpor's answer: `ALLOCATION_LOCK`, one
process-wide lock (waited on with the GIL released), is held by a thread for the whole of each
tag scope and by every MemoryManager call that touches the allocator (pool creation, scope entry
and exit, usage, audit, sleep, wake, close). So torpor itself never meets a callback in flight.
What the lock cannot cover, and the rule for users: while one thread allocates inside a tag
scope, other threads must not free CUDA tensors or call PyTorch's allocator APIs (allocate tags
during set-up, or from one thread; capture CUDA graphs into a tag's pool inside `mm.graph_pool(...)`).
`SegmentStore.lock` is never held across a call into PyTorch's allocator. At interpreter exit
the callbacks do nothing (the process gives everything back).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from torpor.memory import cuda_driver
from torpor.memory.cuda_driver import CudaDriverError, VirtualMemory
from torpor.memory.host_buffer import HostBuffer
from torpor.memory.segments import DeviceOutOfMemory, Segment, SegmentStore
from torpor.memory.system import device_used_bytes
from torpor.memory.types import HostMemoryError

_ALLOC_T = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)

ALLOCATION_LOCK = threading.RLock()  # see the module docstring
# Copies are issued in chunks of this size: one multi-GiB host->device copy ran at half the link's
# speed on an H200 where 16 MiB copies ran at its full speed (docs/memory.md, "What the GPU showed").
COPY_CHUNK_BYTES = 64 << 20
# A segment woken without a copy (discarded: zero-filled) is mapped in pieces of this size: small pieces only
# serve to start a refill's copies early, and each piece costs a cuMemCreate + cuMemMap + cuMemSetAccess
# (1 GiB pieces cost a sixth of 64 MiB ones on an H200: scripts/probe_map_pieces.py, docs/memory.md).
ZERO_FILL_PIECE_BYTES = 1 << 30

# Every store that owns segments, so `audit` can tell "another manager's tag" from "no tag".
_STORES: list[CudaBackend] = []
_STORES_LOCK = threading.Lock()




@dataclass(eq=False)
class CudaSegment(Segment):
    pieces: list[tuple[int, int, Any]] = field(default_factory=list)  # (offset, size, handle) mapped
    copied: Any = None  # CUevent recorded after this segment's offload copy, reused every cycle
    copy_pending: bool = False  # `copied` was recorded and not yet waited for


def _keep_forever(obj: object) -> None:
    """PyTorch keeps raw pointers to the callbacks for the life of the process, possibly past
    interpreter teardown: give the ctypes thunks a reference nobody ever drops."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


class CudaBackend(SegmentStore):
    """Segments of one device, grouped in per-tag memory pools."""

    def __init__(self, device_index: int, host_backup: str = "pinned",
                 max_host_bytes: int | None = None,
                 on_new_segment: Callable[[str, int], None] | None = None, piece_bytes: int = 64 << 20) -> None:
        super().__init__(max_host_bytes)
        self.device_index = device_index
        self.host_backup = host_backup
        self.on_new_segment = on_new_segment
        with torch.cuda.device(device_index):
            torch.cuda.init()
            cuda_driver.make_primary_context_current(device_index)
            self.vm = VirtualMemory(device_index)
            self._stream = cuda_driver.stream_create()
        self.piece_bytes = self.vm.round_up(piece_bytes) if piece_bytes else 0
        self.pools: dict[str, torch.cuda.MemPool] = {}
        self._scopes = threading.local()  # per thread: stack of active use_mem_pool contexts
        self.callback_errors: list[str] = []
        # Giving back pinned memory takes ~0.1 s/GiB (1.5 s for an 8B model's weights, measured on an
        # H200): a discarding sleep hands its old host copies to this thread and returns at once.
        self._host_freer = ThreadPoolExecutor(1, thread_name_prefix="torpor-host-free")
        self._host_frees: list[Future] = []
        with _STORES_LOCK:
            _STORES.append(self)

    # ---- tags and scopes ---------------------------------------------------------------
    def create_tag(self, tag: str) -> None:
        alloc = _ALLOC_T(lambda size, device, stream: self._on_alloc(tag, size))
        free = _FREE_T(lambda ptr, size, device, stream: self._on_free(ptr))
        _keep_forever(alloc)
        _keep_forever(free)
        allocator = torch._C._cuda_customAllocator(
            ctypes.cast(alloc, ctypes.c_void_p).value, ctypes.cast(free, ctypes.c_void_p).value)
        self.pools[tag] = torch.cuda.MemPool(allocator)

    def close(self) -> None:
        """Drop the pools. PyTorch then returns their segments through `free` once their tensors
        are gone and `torch.cuda.empty_cache()` runs; the callbacks keep this object alive."""
        self.pools.clear()
        self.wait_host_frees()

    def pool_id(self, tag: str) -> tuple[int, int]:
        return self.pools[tag].id

    def enter_scope(self, tag: str, parent: str | None) -> None:
        """Make this thread allocate from `tag`'s pool. The caching allocator picks the innermost
        pool on CUDA and the outermost on other backends, so only one pool is ever active."""
        stack = self._stack()
        if parent is not None:
            stack[-1].__exit__(None, None, None)
        _ExpandableSegments.suspend()
        ctx = torch.cuda.use_mem_pool(self.pools[tag], self.device_index)
        ctx.__enter__()
        stack.append(ctx)

    def exit_scope(self, tag: str, parent: str | None) -> None:
        stack = self._stack()
        stack.pop().__exit__(None, None, None)
        _ExpandableSegments.resume()
        if parent is not None:
            stack[-1] = torch.cuda.use_mem_pool(self.pools[parent], self.device_index)
            stack[-1].__enter__()

    def _stack(self) -> list:
        if not hasattr(self._scopes, "stack"):
            self._scopes.stack = []
        return self._scopes.stack

    # ---- allocator callbacks (run under the caching allocator's lock) -------------------
    def _on_alloc(self, tag: str, size: int) -> int | None:
        try:
            if tag in self.asleep:
                self.callback_errors.append(f"allocation of {size} bytes into sleeping tag {tag!r} refused")
                return None
            rsize = self.vm.round_up(size)
            address = self.vm.reserve(rsize)
            try:
                handle = self.vm.map(address, rsize)
            except CudaDriverError:
                self.vm.free_range(address, rsize)
                return None  # PyTorch frees cached blocks, retries, then raises OutOfMemoryError
            self.add(CudaSegment(address, rsize, tag, pieces=[(0, rsize, handle)]))
            if self.on_new_segment is not None:
                self.on_new_segment(tag, rsize)
            return address
        except BaseException:  # an exception must never cross into C++
            self.callback_errors.append(traceback.format_exc())
            return None

    def _on_free(self, ptr: int | None, _is_finalizing=sys.is_finalizing) -> None:
        if ptr is None or _is_finalizing():
            return
        try:
            seg = self.pop(ptr)
            if seg is None:
                return
            self._unmap_pieces(seg)
            self.vm.free_range(seg.address, seg.size)
            if seg.backup is not None:
                seg.backup.free()
            if seg.copied is not None:
                cuda_driver.event_destroy(seg.copied)
        except BaseException:
            self.callback_errors.append(traceback.format_exc())

    # ---- device primitives for SegmentStore --------------------------------------------
    def _stream_handle(self) -> Any:
        return self._stream

    def _reserve_backups(self, segments: list[Segment]) -> None:
        if any(seg.backup is None for seg in segments):
            self.wait_host_frees()  # old copies go before new ones are pinned
        made: list[Segment] = []
        try:
            for seg in segments:
                if seg.backup is None:
                    seg.backup = HostBuffer.allocate(seg.size, self.host_backup)
                    made.append(seg)
        except (MemoryError, OSError, CudaDriverError) as exc:
            for seg in made:
                seg.backup.free()
                seg.backup = None
            need = sum(s.size for s in segments) / 2**20
            raise HostMemoryError(f"no host memory for a {need:.0f} MiB {self.host_backup} offload ({exc}); "
                                  "nothing was released") from None

    def reserve_one(self, tags: list[str]) -> int | None:
        """The host copy of one more segment of `tags`, pinned *outside* the store's lock: pinning takes
        ~0.2 s per GiB, and the engine's own work meanwhile (new segments, scopes) takes that lock. The buffer
        is attached if the segment still needs it when pinning ends, else given back (returns 0)."""
        with self.lock:
            seg = self._next_unreserved(tags)
            if seg is None:
                return None
            self._check_host_budget([seg])
        self.wait_host_frees()  # old copies go before new ones are pinned
        try:
            buffer = HostBuffer.allocate(seg.size, self.host_backup)
        except (MemoryError, OSError, CudaDriverError) as exc:
            raise HostMemoryError(f"no host memory for a {seg.size / 2**20:.0f} MiB {self.host_backup} copy "
                                  f"({exc})") from None
        with self.lock:
            if self.segments.get(seg.address) is seg and seg.resident and seg.backup is None:
                seg.backup = buffer
                return buffer.size
        buffer.free()  # the segment went, or a sleep made its copy meanwhile
        return 0

    def backup_size(self, segment: Segment) -> int:
        return segment.backup.size

    def _free_backup(self, segment: Segment) -> None:
        if segment.backup.kind != "pinned":
            segment.backup.free()
            return
        self._host_frees.append(self._host_freer.submit(_free_host_buffer, segment.backup, self.device_index))

    def wait_host_frees(self) -> None:
        """Wait until the host copies handed to the background thread are given back."""
        frees, self._host_frees = self._host_frees, []
        for future in frees:
            future.result()

    def _synchronize(self) -> None:
        torch.cuda.synchronize(self.device_index)

    def _copy_out(self, segments: list[Segment]) -> None:
        # Queue every copy, each followed by its own event, so `_release` can unmap a segment
        # as soon as its copy is done while later copies still run.
        stream = self._stream_handle()
        for seg in segments:
            for offset, size in _chunks(seg.size):
                cuda_driver.copy_d2h(seg.backup.ptr + offset, seg.address + offset, size, stream)
            if seg.copied is None:
                seg.copied = cuda_driver.event_create()
            cuda_driver.event_record(seg.copied, stream)
            seg.copy_pending = True

    def _release(self, segment: Segment) -> None:
        if segment.copy_pending:
            cuda_driver.event_synchronize(segment.copied)
            segment.copy_pending = False
        self._unmap_pieces(segment)

    def _unmap_pieces(self, segment: Segment) -> None:
        while segment.pieces:
            offset, size, handle = segment.pieces.pop()
            self.vm.unmap(segment.address + offset, size, handle)

    def _restore(self, segment: Segment) -> None:
        stream = self._stream_handle()
        piece = self.piece_bytes or segment.size
        if not segment.holds_copy:  # nothing to copy, so nothing to start early: few, large pieces
            piece = max(piece, self.vm.round_up(ZERO_FILL_PIECE_BYTES))
        for offset in range(0, segment.size, piece):
            size = min(piece, segment.size - offset)
            try:
                handle = self.vm.map(segment.address + offset, size)
            except CudaDriverError as exc:
                cuda_driver.stream_synchronize(stream)  # queued refills of this segment first
                self._unmap_pieces(segment)
                if exc.out_of_memory:
                    raise DeviceOutOfMemory(str(exc)) from None
                raise
            segment.pieces.append((offset, size, handle))
            for start, n in _chunks(size, offset):
                if segment.holds_copy:
                    cuda_driver.copy_h2d(segment.address + start, segment.backup.ptr + start, n, stream)
                else:
                    cuda_driver.memset_zero(segment.address + start, n, stream)

    def _finish_fills(self) -> None:
        cuda_driver.stream_synchronize(self._stream_handle())

    def _finish_copies(self, segments: list[Segment]) -> None:
        for seg in segments:
            if seg.copy_pending:
                cuda_driver.event_synchronize(seg.copied)
                seg.copy_pending = False

    def _copy_in(self, segments: list[Segment]) -> None:
        stream = self._stream_handle()
        for seg in segments:
            for offset, size in _chunks(seg.size):
                cuda_driver.copy_h2d(seg.address + offset, seg.backup.ptr + offset, size, stream)
        cuda_driver.stream_synchronize(stream)

    def _read_device(self, segment: Segment, offset: int, size: int) -> bytes:
        staging = (ctypes.c_char * size)()
        cuda_driver.copy_d2h(ctypes.addressof(staging), segment.address + offset, size, self._stream_handle())
        cuda_driver.stream_synchronize(self._stream_handle())
        return staging.raw

    def _read_copy(self, segment: Segment, offset: int, size: int) -> bytes:
        return ctypes.string_at(segment.backup.ptr + offset, size)

    # ---- readings ----------------------------------------------------------------------
    def allocated_bytes(self) -> tuple[dict[str, int], int]:
        """Bytes in live tensors per tag, and bytes of segments on this device that belong to no
        torpor tag (the default pool and any pool torpor does not manage)."""
        per_tag: dict[str, int] = {}
        untagged = 0
        with _STORES_LOCK:
            others = [s for s in _STORES if s is not self and s.device_index == self.device_index]
        for seg in torch.cuda.memory_snapshot():
            if seg["device"] != self.device_index:
                continue
            mine = self.segments.get(seg["address"])
            if mine is not None:
                per_tag[mine.tag] = per_tag.get(mine.tag, 0) + seg["allocated_size"]
            elif not any(seg["address"] in s.segments for s in others):
                untagged += seg["total_size"]
        return per_tag, untagged

    def device_used_bytes(self) -> int:
        return device_used_bytes(torch.device("cuda", self.device_index))

    # ---- before a context checkpoint ---------------------------------------------------
    def pci_bus_id(self) -> str:
        """The device's PCI bus id, which NVML (in the checkpoint helper) finds it by."""
        return cuda_driver.pci_bus_id(self.device_index)

    def quiesce(self) -> None:
        """No CUDA work of this backend left in flight: host copies freed, the device synchronized."""
        self.wait_host_frees()
        torch.cuda.synchronize(self.device_index)


def _free_host_buffer(buffer: HostBuffer, device_index: int) -> None:
    cuda_driver.make_primary_context_current(device_index)  # cuMemFreeHost needs a current context
    buffer.free()


def _chunks(size: int, start: int = 0, chunk: int = COPY_CHUNK_BYTES) -> list[tuple[int, int]]:
    """(offset, size) pieces of at most `chunk` bytes covering [start, start + size)."""
    return [(start + o, min(chunk, size - o)) for o in range(0, size, chunk)]


class _ExpandableSegments:
    """`expandable_segments:True` makes the caching allocator map its own memory instead of
    calling a pool's allocator, so tag pools would silently stop releasing memory. While any tag
    scope is active the setting is switched off (it only affects new segments), then restored."""

    _depth = 0
    _lock = threading.Lock()

    @staticmethod
    def requested() -> bool:
        conf = ",".join(os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
        return "expandable_segments:true" in conf.replace(" ", "").lower()

    @classmethod
    def suspend(cls) -> None:
        with cls._lock:
            cls._depth += 1
            if cls._depth == 1 and cls.requested():
                _set_allocator_settings("expandable_segments:False")

    @classmethod
    def resume(cls) -> None:
        with cls._lock:
            cls._depth -= 1
            if cls._depth == 0 and cls.requested():
                _set_allocator_settings("expandable_segments:True")


def _set_allocator_settings(settings: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.10
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(settings)
