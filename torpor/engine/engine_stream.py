"""The engine's own CUDA stream: every kernel of one engine (loading, profiling, steps, graph capture)
runs on it, and the stream owns the engine's GEMM workspace (gemm.py).

The stream is made through the driver: PyTorch's first `torch.cuda.Stream()` builds its whole stream
pool (+70 MiB of device memory, measured on an H200), which would stay while the engine sleeps. The
GEMM workspace is made inside the `workspace` memory tag, so it sleeps and wakes with the engine and
comes back at the same address (captured graphs hold it).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

from torpor.engine import gemm
from torpor.memory import create_stream

# Streams of closed engines, per device, for the next engine. A stream is never destroyed: pinned host
# buffers that took part in its copies record an event on it when they are freed, which may be after
# the engine is gone (a destroyed stream then aborts the process).
_SPARE_STREAMS: dict[int, list[Any]] = {}
_SPARE_LOCK = threading.Lock()


class EngineStream:
    """A driver-made stream of `device`, or nothing on CPU (every method is then a no-op)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.gemm_workspace: torch.Tensor | None = None
        self._handle = None
        self.stream: torch.cuda.ExternalStream | None = None
        if device.type == "cuda":

            with _SPARE_LOCK:
                spare = _SPARE_STREAMS.get(device.index, [])
                self._handle = spare.pop() if spare else None
            if self._handle is None:
                with torch.cuda.device(device):
                    torch.zeros(1, device=device)  # the primary context exists and is current
                    self._handle = create_stream()
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

    def make_gemm_workspace(self, use_torch: bool = False) -> None:
        """The GEMM workspace of this stream, made now (call inside the memory tag that should hold it);
        `use_torch`: no workspace, the stream's GEMMs go through F.linear (EngineConfig.gemm "torch")."""
        if self.stream is None or self.gemm_workspace is not None:
            return
        if not use_torch:
            self.gemm_workspace = torch.empty(gemm.workspace_bytes(self.device), dtype=torch.uint8,
                                              device=self.device)
        gemm.set_workspace(int(self._handle), self.gemm_workspace, use_torch)

    def close(self) -> None:
        """Drop the GEMM workspace and keep the stream for the next engine (streams are never destroyed, see
        _SPARE_STREAMS). Nothing happens while the interpreter shuts down."""
        if self._handle is None or sys.is_finalizing():
            return
        torch.cuda.synchronize(self.device)
        gemm.drop_workspace(int(self._handle))
        self.gemm_workspace = None
        with _SPARE_LOCK:
            _SPARE_STREAMS.setdefault(self.device.index, []).append(self._handle)
        self._handle, self.stream = None, None
