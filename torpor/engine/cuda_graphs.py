"""Decode CUDA graphs: one per batch-size bucket, over the persistent `DecodeBuffers`."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from torpor.engine.inputs import DecodeBuffers
from torpor.env import Env


@functools.cache
def capture_stream(device_index: int) -> torch.cuda.Stream:
    """The stream every engine of the process captures its graphs on. cuBLAS keeps a workspace per
    stream for the life of the process, made by the first GEMM on it: the warm-up makes it outside the
    graph pool (so no other code's captures ever use memory of the engine's sleepable pool), and one
    shared stream keeps it to one workspace however many engines come and go."""
    if not Env.read().driver_capture_stream:
        return torch.cuda.Stream(device=device_index)
    from torpor.memory import cuda_driver

    with torch.cuda.device(device_index):
        handle = cuda_driver.stream_create()
    stream = torch.cuda.ExternalStream(int(handle), device=torch.device("cuda", device_index))
    # torch.cuda.graph() makes a default capture stream the first time, through PyTorch's stream pool.
    torch.cuda.graph.default_capture_stream = stream
    return stream


def run_decode(model: nn.Module, buffers: DecodeBuffers, batch_size: int, max_context_len: int) -> torch.Tensor:
    """One decode forward over the first `batch_size` rows of `buffers`, output copied to `buffers.hidden`.
    The eager path and graph capture run exactly this, so both compute the same thing."""
    input_ids, positions, metadata = buffers.inputs(batch_size, max_context_len)
    buffers.hidden[:batch_size].copy_(model(input_ids, positions, metadata))
    return buffers.hidden[:batch_size]


class CudaGraphRunner:
    """Captures `run_decode` for every size in `batch_sizes`, largest first so the smaller graphs reuse
    the pool memory of the larger ones. The pool is the `cuda_graph` tag of `memory` when given (it then
    sleeps and wakes with the tag), else a private pool. Replay reads whatever `buffers.load` copied in."""

    def __init__(self, model: nn.Module, buffers: DecodeBuffers, batch_sizes: tuple[int, ...],
                 max_model_len: int, memory=None) -> None:
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None if memory is not None else torch.cuda.graph_pool_handle()
        stream = capture_stream(torch.cuda.current_device())
        for batch_size in sorted(batch_sizes, reverse=True):
            # Warm-up: Triton compiles, cuBLAS picks its kernels.
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                run_decode(model, buffers, batch_size, max_model_len)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            scope = memory.graph_pool("cuda_graph") if memory is not None else contextlib.nullcontext(pool)
            with scope as graph_pool, torch.cuda.graph(graph, pool=graph_pool, stream=stream):
                run_decode(model, buffers, batch_size, max_model_len)
            self.graphs[batch_size] = graph
        torch.cuda.synchronize()

    def replay(self, buffers: DecodeBuffers, batch_size: int) -> torch.Tensor:
        self.graphs[batch_size].replay()
        return buffers.hidden[:batch_size]
