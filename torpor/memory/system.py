"""What the rest of torpor reads about the machine's memory, and the one driver object it needs: the
process's resident set, the device memory in use, a driver-made CUDA stream. (The engine uses these; the
internals they wrap, `cuda_driver` and the backends, stay private to torpor.memory.)"""

from __future__ import annotations

import mmap
from typing import Any

import torch


def process_rss_bytes() -> int:
    """Resident set size of this process (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def device_used_bytes(device: str | torch.device) -> int:
    """Memory in use on `device`: the whole CUDA device (every process, every allocator), or on CPU this
    process's RSS."""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    return process_rss_bytes()


def create_stream() -> Any:
    """A non-blocking CUDA stream of the current context, made through the driver (PyTorch's first extra
    stream creates its whole stream pool, ~70 MiB of device memory). Kept for the process's life."""
    from torpor.memory import cuda_driver  # cuda-bindings: CUDA only

    return cuda_driver.stream_create()
