"""The start-up's weight load, on a thread of its own beside the KV-cache sizing and the CUDA-graph capture.

Neither of those needs the weights' values: the sizing reads how much memory a step takes, the graphs record
the parameters' addresses (an eager warm-up step runs before each capture, on whatever the parameters hold so
far; its output and the K/V it writes into the scratch block are thrown away). So the copies of the checkpoint
(`staging.copy_planned`, ~1 s for 16 GB) run meanwhile, and the engine serves only after `finish`.

What runs where:
- the caller's thread: the plan (every header, name, shape and dtype checked before any byte is written, so a
  bad checkpoint fails the start-up at once), the staging buffers (pinned there at the first load) and, in
  `finish`, the finite check and the debug line;
- the load's thread: only the reads and copies, on a stream of its own (CUDA), with half the reader threads of a
  plain load (`beside_threads`). It allocates no device memory
  from Python and frees none (the finite check's temporaries would): a thread holding the GIL while it waits for
  the caching allocator's mutex could deadlock with a capture whose allocator callback needs the GIL
  (docs/memory.md, "Threads"). It still records and waits for events: the graphs are captured in the
  "thread_local" capture mode meanwhile ("global" would let another thread's call end a capture).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path

import torch
from torch import nn

from torpor.engine import phase_times
from torpor.engine.weights.index import CheckpointError
from torpor.engine.weights.loader import check_finite, load_failed, plan_checkpoint
from torpor.engine.weights.staging import StagingBuffers, copy_reads, prepare_reads, usable_cpus

logger = logging.getLogger("torpor.engine")


def beside_threads(staging: StagingBuffers) -> int:
    """Reader threads of a load beside the start-up: EngineConfig.load_threads when given, else half the
    staging's (they copy from the page cache at the cores' speed and would take the cores the graph capture's
    Python needs)."""
    return staging.threads if staging.threads_given else max(1, min(staging.threads, usable_cpus()) // 2)


class BackgroundLoad:
    """`path` planned against `model` now (CheckpointError if it does not fit), copied on a new thread through
    `staging` on `stream` (a CUDA stream, or None on CPU). Call `finish` (or `abandon`) exactly once."""

    def __init__(self, model: nn.Module, path: str | Path, staging: StagingBuffers,
                 stream: torch.cuda.Stream | None) -> None:
        self.path = path
        self._start = time.perf_counter()
        self._entries, self._copies = plan_checkpoint(model, path)
        self._reads = prepare_reads(self._entries, self._copies, staging)  # buffers pinned here, not beside a capture
        self.threads = beside_threads(staging)
        self._planned = time.perf_counter()
        self._staging, self._stream = staging, stream
        self._device = next(model.parameters()).device
        self._error: BaseException | None = None
        self._nbytes = 0
        self._copied = self._planned
        self._thread = threading.Thread(target=self._run, name="torpor-weight-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._stream is not None:
                torch.cuda.set_device(self._device)  # a new thread starts on device 0
            with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
                self._nbytes = copy_reads(self._reads, self._staging, self.threads)  # synchronizes the stream
        except BaseException as e:  # re-raised by finish, on the caller's thread
            self._error = e
        self._copied = time.perf_counter()

    def finish(self) -> None:
        """Wait for the copies, then check every parameter is finite; CheckpointError (weights_written) if the
        load failed. Logs the load's split at debug level (its own thread's seconds, and the wait)."""
        waited = time.perf_counter()
        self._thread.join()
        joined = time.perf_counter()
        if isinstance(self._error, CheckpointError):
            raise self._error
        if self._error is not None:
            raise load_failed(self.path, self._error) from self._error
        check_finite(self._copies)
        seconds = self._copied - self._planned
        logger.debug("loaded %.3f GB from %s beside the start-up: plan %.3f s, copy %.3f s (%.1f GB/s), finite "
                     "check %.3f s", self._nbytes / 1e9, self.path, self._planned - self._start, seconds,
                     self._nbytes / 1e9 / max(seconds, 1e-9), time.perf_counter() - joined)
        logger.debug("weight load beside the start-up: %.3f s, waited for %.3f s (%d reader threads)",
                     self._copied - self._start, joined - waited, self.threads)
        phase_times.add("weight_load_beside", self._copied - self._start)  # the load's own thread

    def abandon(self) -> None:
        """The start-up failed meanwhile: wait for the copies (they write into the parameters), drop any error."""
        self._thread.join()
