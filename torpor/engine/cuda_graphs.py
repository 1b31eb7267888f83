"""Decode CUDA graphs: one per batch-size bucket, over the persistent `DecodeBuffers`."""

from __future__ import annotations

import contextlib
import logging
import time

import torch
from torch import nn

from torpor.engine import phase_times
from torpor.engine.inputs import DecodeBuffers

logger = logging.getLogger("torpor.engine")


def run_decode(model: nn.Module, buffers: DecodeBuffers, batch_size: int, max_context_len: int) -> torch.Tensor:
    """One decode forward over the first `batch_size` rows of `buffers`, output copied to `buffers.hidden`.
    The eager path and graph capture run exactly this, so both compute the same thing."""
    input_ids, positions, metadata = buffers.inputs(batch_size, max_context_len)
    buffers.hidden[:batch_size].copy_(model(input_ids, positions, metadata))
    return buffers.hidden[:batch_size]


class CudaGraphRunner:
    """Captures `run_decode` for every size in `batch_sizes`, largest first so the smaller graphs reuse
    the pool memory of the larger ones. The pool is the `cuda_graph` tag of `memory` when given (it then
    sleeps and wakes with the tag), else a private pool. Call on a side stream (the engine's). Replay reads
    whatever `buffers.load` copied in. `capture_error_mode`: CUDA's ("global", "thread_local", "relaxed"):
    "thread_local" while another thread of the process makes CUDA calls (the start-up's weight load).
    Only the first (largest) size gets an eager warm-up step before its capture; the other sizes' first uses
    (Triton's specializations, the GEMM plans of their row counts) happen inside their captures, which keeps the
    capture phase short (docs/benchmarks.md) and the graphs bit-identical to eager."""

    def __init__(self, model: nn.Module, buffers: DecodeBuffers, batch_sizes: tuple[int, ...],
                 max_model_len: int, memory=None, capture_error_mode: str = "global") -> None:
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None if memory is not None else torch.cuda.graph_pool_handle()
        for batch_size in sorted(batch_sizes, reverse=True):
            start = time.perf_counter()
            if not self.graphs:
                run_decode(model, buffers, batch_size, max_model_len)  # warm-up: Triton compiles, GEMM plans made
            graph = torch.cuda.CUDAGraph()
            scope = memory.graph_pool("cuda_graph") if memory is not None else contextlib.nullcontext(pool)
            with scope as graph_pool:
                # This stream only: a weight load beside the capture keeps the device busy on another.
                torch.cuda.current_stream().synchronize()
                warmed = time.perf_counter()
                # Captured on the current (the engine's) stream, not through torch.cuda.graph(): that
                # makes a default capture stream, i.e. PyTorch's whole stream pool, whatever stream it is given.
                graph.capture_begin(pool=graph_pool, capture_error_mode=capture_error_mode)
                try:
                    run_decode(model, buffers, batch_size, max_model_len)
                finally:
                    graph.capture_end()  # also instantiates the graph
            self.graphs[batch_size] = graph
            _log_capture(batch_size, warmed - start, time.perf_counter() - warmed)
        torch.cuda.current_stream().synchronize()

    def replay(self, buffers: DecodeBuffers, batch_size: int) -> torch.Tensor:
        self.graphs[batch_size].replay()
        return buffers.hidden[:batch_size]


def _log_capture(batch_size: int, warm_up_s: float, capture_s: float) -> None:
    """TORPOR_DEBUG=1: where the capture phase's time goes, per batch size. The warm-up (an eager step, until
    the device finished it) of the first, largest size also carries the start-up's first uses: Triton's
    kernels loaded from its cache, cuBLASLt's plans (when the KV sizing was read back, no step ran before)."""
    logger.debug("cuda graph batch size %d: warm-up %.3f s, capture %.3f s", batch_size, warm_up_s, capture_s)
    phase_times.add("cuda_graph_warm_up", warm_up_s)
