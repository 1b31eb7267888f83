"""torch's shared-memory files (the `file_system` sharing strategy), opened by this process directly.

A CPU tensor pickled by `torch.multiprocessing` travels as the name of a file in /dev/shm that its process created
through torch's `torch_shm_manager`. torch's own receiver (`rebuild_storage_filename`) connects to that manager and
registers the file with it: the manager, and every file it registered, then lives until the receiver exits (an
engine stayed connected to every trainer it ever heard from, and the files of a trainer killed mid-push stayed in
/dev/shm until the engine exited). Here the file is mapped read-only from /dev/shm itself, after its size was checked
on the open file: no connection, and the mapping goes with the last tensor that uses it. The trainer's manager then
ends with the trainer and removes what the trainer left.

The file starts with torch's reference count (`at::RefcountedMapAllocator`: a `std::atomic<int>`, the data 64
bytes in). A pickle adds one reference for its receiver to take over (`storage._shared_incref()`); the last
reference to go unlinks the file. `release_pickled_reference` is the receiver's side of that protocol: it takes
the reference back, but never the last one (a replayed or forged payload carries none). `settle_references` is the
sender's side: after the answers came, the references its undelivered pickles added go (a request the engine
refused before opening it), so its file goes when its buffer does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
import re
import stat
import threading
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
HEADER_BYTES = 64  # torch's RefcountedMapAllocator: the reference count, then the data at this offset
_NAME = re.compile(r"/torch_\d+_\d+_\d+")
logger = logging.getLogger("torpor.engine")

# A tensor over a read-only mapping: torch warns, once per process, that writing through it is undefined. Nothing
# writes to a trainer's memory here (a stray write would fault rather than change the trainer's tensors): that one
# warning is spent now, where it says nothing (a filter would be the process's, and not thread-safe to scope).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(b"\0", dtype=torch.uint8)


class SharedFileError(ValueError):
    """A shared-memory file that cannot be opened as the payload describes it (gone, not torch's, too small)."""


def is_torch_name(handle: str) -> bool:
    """A name torch's `NewProcessWideShmHandle` makes (`/torch_<pid>_<n>_<n>`): one file directly in /dev/shm."""
    return bool(_NAME.fullmatch(handle))


# ---- mapping (the receiver) ---------------------------------------------------------------------------
@dataclass(eq=False)
class _Mapped:
    """One file mapped here: its data read-only, its count (the first page) read-write, both unmapped when the
    last tensor over the data goes."""

    nbytes: int
    data: weakref.ref  # the data's mmap, alive while a tensor uses it
    header: mmap.mmap
    count: ctypes.c_int32  # the count, in `header`


_open_lock = threading.RLock()  # a mapping's finalizer may run in a thread that holds it
_open: dict[str, _Mapped] = {}  # by name: a push that cycles through a few buffers maps each once


def open_shared(handle: str, nbytes: int) -> torch.UntypedStorage:
    """The first `nbytes` of torch's shared-memory file `handle`, mapped read-only (a mapping of it still alive
    in this process is reused), and the reference its pickle added taken back (`release_pickled_reference`).
    Raises SharedFileError naming the problem."""
    if not is_torch_name(handle):
        raise SharedFileError(f"shared-memory name {handle[:80]!r} is not a torch shared-memory file")
    with _open_lock:
        mapped = _open.get(handle)
        data = mapped.data() if mapped is not None and mapped.nbytes >= nbytes else None
        if data is None:
            mapped, data = _map(handle, nbytes)
        elif data.size() - HEADER_BYTES < nbytes:  # the file's size now (an fstat): one that shrank is not read
            raise SharedFileError(f"shared-memory file {handle} holds {data.size() - HEADER_BYTES} bytes now, the "
                                  f"payload claims {nbytes}")
        release_pickled_reference(mapped.count)
    if nbytes == 0:
        return torch.UntypedStorage()
    return torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=HEADER_BYTES).untyped_storage()


def _map(handle: str, nbytes: int) -> tuple[_Mapped, mmap.mmap]:
    path = SHM_DIR / handle.lstrip("/")
    try:  # O_NOFOLLOW: the name itself, never where a link put there points
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SharedFileError(f"shared-memory file {handle} does not exist (the trainer freed it, or died)") from None
    except OSError as e:
        raise SharedFileError(f"cannot open shared-memory file {handle}: {e.strerror}") from None
    try:
        info = os.fstat(fd)  # the open file's size: a file renamed or replaced since cannot slip in
        available = info.st_size - HEADER_BYTES
        if not stat.S_ISREG(info.st_mode) or available < 0:
            raise SharedFileError(f"shared-memory file {handle} is not one of torch's (no reference count)")
        if nbytes > available:  # mapping past its end would crash this process (SIGBUS) on first touch
            raise SharedFileError(f"shared-memory file {handle} holds {available} bytes, the payload claims {nbytes}")
        # The data shared (a reused buffer's new contents are seen) and read-only; the count writable.
        data = mmap.mmap(fd, HEADER_BYTES + nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        header = mmap.mmap(fd, HEADER_BYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    mapped = _Mapped(nbytes, weakref.ref(data), header, ctypes.c_int32.from_buffer(header))
    weakref.finalize(data, _unmap, handle, mapped)
    _open[handle] = mapped
    return mapped, data


def _unmap(handle: str, mapped: _Mapped) -> None:
    """The data's last tensor went: the count's mapping goes too, and the name is forgotten."""
    with _open_lock:
        if _open.get(handle) is mapped:
            del _open[handle]
        del mapped.count  # the buffer export, before the close
        mapped.header.close()


# ---- the reference count ------------------------------------------------------------------------------
def release_pickled_reference(count: ctypes.c_int32) -> None:
    """The receiver's part of torch's protocol: take back the one reference a pickle of this file added for its
    receiver (torch's receiver decrements as it opens, as `_shared_decref` does), but never the last one. A
    payload is no proof that a reference was added for it: a request sent twice (a client's retry after a
    timeout), or a payload naming another process's file, would take the owner's own reference, and the file
    would go while its owner still uses it, or never. The owner's mapping is one of the references as long as it
    maps the file, so the last one may be its own, never a pickle's to give back. The file is never unlinked here
    (this process holds no reference of its own); the owner's last reference unlinks it. The one case left over:
    an owner that drops its buffer before the receiver opened the pickle leaves the file to its manager, which
    removes it when the owner exits."""
    _update_count(count, lambda value: value - 1 if value > 1 else None)


def settle_references(storage: torch.UntypedStorage) -> None:
    """The sender's part, once every request that carried `storage` was answered: its count back to one (this
    process's own mapping). A pickle the engine never opened (a request refused before it was read) leaves its
    reference behind, and the file would outlive the buffer until this process exits."""
    if storage.device.type != "cpu" or not storage.is_shared() or storage.nbytes() == 0:
        return
    handle = storage._share_filename_cpu_()[1]  # the name of a storage already shared: nothing is created
    handle = handle.decode() if isinstance(handle, bytes) else handle
    try:
        fd = os.open(SHM_DIR / handle.lstrip("/"), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        header = mmap.mmap(fd, HEADER_BYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    count = ctypes.c_int32.from_buffer(header)
    try:
        _update_count(count, lambda value: 1 if value > 1 else None)
    finally:
        del count
        header.close()


def count_of(handle: str) -> int:
    """A shared-memory file's reference count now (tests and diagnostics)."""
    with open(SHM_DIR / handle.lstrip("/"), "rb") as f:
        return int.from_bytes(f.read(4), "little", signed=True)


def _update_count(count: ctypes.c_int32, change) -> int | None:
    """Compare-and-swap a file's `count` (in a shared mapping of it) with `change(value)` (None: leave it), as
    torch's own atomic updates do: the owner may add or drop references meanwhile. Returns the value written."""
    atomic = _atomics()
    if atomic is None:  # no libatomic: a count is never changed by a plain read-modify-write that could lose one
        return None
    load, compare_exchange = atomic
    address, expected = ctypes.addressof(count), ctypes.c_int32()
    while True:
        expected.value = load(address, _SEQ_CST)
        wanted = change(expected.value)
        if wanted is None:
            return None
        if compare_exchange(address, ctypes.byref(expected), wanted, _SEQ_CST, _SEQ_CST):
            return wanted


_SEQ_CST = 5  # __ATOMIC_SEQ_CST


@functools.cache
def _atomics():
    """libatomic's 4-byte load and compare-exchange (what `std::atomic<int>` compiles to), or None without it."""
    try:
        lib = ctypes.CDLL("libatomic.so.1")
    except OSError:
        name = ctypes.util.find_library("atomic")  # runs ldconfig: only where the usual name is not found
        try:
            lib = ctypes.CDLL(name) if name else None
        except OSError:
            lib = None
    if lib is None:
        logger.warning("libatomic not found: shared-memory reference counts are left alone, so a trainer's files "
                       "are removed when it exits, not when it drops them")
        return None
    load = getattr(lib, "__atomic_load_4")
    load.argtypes, load.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_int32
    compare_exchange = getattr(lib, "__atomic_compare_exchange_4")
    compare_exchange.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int, ctypes.c_int]
    compare_exchange.restype = ctypes.c_bool
    return load, compare_exchange
