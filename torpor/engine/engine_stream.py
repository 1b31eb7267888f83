"""The engine's own CUDA stream: every kernel of one engine (loading, profiling, steps, graph capture)
runs on it.

Why not PyTorch's current stream: cuBLAS gets one workspace per (handle, stream) from PyTorch's caching
allocator on the first GEMM of a stream, and PyTorch keeps it for the life of the process. On the
engine's stream that first GEMM runs inside the `workspace` memory tag, so the workspaces sleep and wake
with the engine (captured graphs hold their address: the tag comes back at the same one). The stream is
made through the driver: PyTorch's first `torch.cuda.Stream()` builds its whole stream pool (+70 MiB of
device memory, measured on an H200), which would stay while the engine sleeps.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

# Streams of closed engines, per device, for the next engine. A stream is never destroyed: pinned host
# buffers that took part in its copies record an event on it when they are freed, which may be after
# the engine is gone (a destroyed stream then aborts the process).
_SPARE_STREAMS: dict[int, list[Any]] = {}
_NUM_OPEN: dict[int, int] = {}  # engine streams in use, per device
_SPARE_LOCK = threading.Lock()


class EngineStream:
    """A driver-made stream of `device`, or nothing on CPU (every method is then a no-op)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._blas_threads: set[int] = set()  # threads whose cuBLAS handle has workspaces on this stream
        self._handle = None
        self.stream: torch.cuda.ExternalStream | None = None
        if device.type == "cuda":
            from torpor.memory import cuda_driver

            with _SPARE_LOCK:
                spare = _SPARE_STREAMS.get(device.index, [])
                self._handle = spare.pop() if spare else None
                _NUM_OPEN[device.index] = _NUM_OPEN.get(device.index, 0) + 1
            if self._handle is None:
                with torch.cuda.device(device):
                    torch.zeros(1, device=device)  # the primary context exists and is current
                    self._handle = cuda_driver.stream_create()
            self.stream = torch.cuda.ExternalStream(int(self._handle), device=device)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Run the block on the engine's stream, ordered after the caller's pending work; the caller's
        stream then waits for the block's work (tensors handed in or out are safe to use)."""
        if self.stream is None:
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            caller.wait_stream(self.stream)

    def has_blas_workspaces(self) -> bool:
        """Whether this thread's cuBLAS handle has its workspaces on the stream (always True on CPU).
        PyTorch keeps one cuBLAS handle per thread, and a workspace per handle and stream."""
        return self.stream is None or threading.get_ident() in self._blas_threads

    def make_blas_workspaces(self, dtype: torch.dtype) -> None:
        """This thread's cuBLAS and cuBLASLt workspaces on the stream, made now (call inside the memory
        tag that should hold them): a GEMM and a GEMM with a bias epilogue, in the model's dtype."""
        if self.stream is None:
            return
        self._blas_threads.add(threading.get_ident())
        with self.scope():
            a = torch.ones(16, 16, device=self.device, dtype=dtype)
            F.linear(a, a)
            F.linear(a, a, a[0])

    def close(self) -> None:
        """The last engine of a device drops PyTorch's cached cuBLAS workspaces (the engine's live in its
        memory tags, which are going away; PyTorch makes new ones for other streams on their next GEMM)
        and keeps its stream for the next engine. While other engines run, clearing would also drop their
        workspaces, which their graphs hold: the workspaces and the stream then stay until the process
        ends. Nothing happens while the interpreter shuts down."""
        if self._handle is None or sys.is_finalizing():
            return
        index = self.device.index
        torch.cuda.synchronize(self.device)
        with _SPARE_LOCK:
            _NUM_OPEN[index] -= 1
            if _NUM_OPEN[index] == 0:
                torch._C._cuda_clearCublasWorkspaces()
                _SPARE_STREAMS.setdefault(index, []).append(self._handle)
        self._handle, self.stream = None, None
