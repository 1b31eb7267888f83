"""Host buffers that hold device segments while they sleep.

`pinned` buffers are page-locked (`cuMemHostAlloc`), so copies run at the host link's speed and
asynchronously; they are allocated once per segment and reused every cycle, because pinning
costs about 0.5 s/GiB. `pageable` buffers are anonymous mmaps: no pinned memory is used and the
kernel can swap them, at the cost of slower, staged copies.
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass

from torpor.memory import cuda_driver

HOST_BACKUPS = ("pinned", "pageable")


@dataclass(eq=False)
class HostBuffer:
    ptr: int
    size: int
    kind: str
    _mmap: mmap.mmap | None = None

    @classmethod
    def allocate(cls, size: int, kind: str) -> HostBuffer:
        """Raises MemoryError (or CudaDriverError) when the host has no memory for it."""
        if kind == "pinned":
            return cls(cuda_driver.host_alloc_pinned(size), size, kind)
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        anchor = ctypes.c_char.from_buffer(m)
        ptr = ctypes.addressof(anchor)
        del anchor  # drop the buffer export so the mmap can be closed later
        return cls(ptr, size, kind, m)

    def free(self) -> None:
        if self.kind == "pinned":
            cuda_driver.host_free_pinned(self.ptr)
        elif self._mmap is not None:
            self._mmap.close()
        self.ptr = 0
