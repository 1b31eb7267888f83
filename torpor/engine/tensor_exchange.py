"""Tensor parallelism's collectives on one node without NCCL: all-reduce, all-gather and broadcast through a
symmetric buffer that every rank maps (see exchange_kernel.py for the protocol).

Why not NCCL: its communicator holds ~1 GiB per GPU outside every allocator (buffers per peer and channel,
proxy and work queues), referenced by the captured decode graphs, so an asleep engine kept it (measured
+974 MiB per GPU at TP=2 against +56 at TP=1). This buffer is 8 MiB per rank, released with the rest of the
engine at sleep and mapped again at the same addresses at wake, so the graphs that captured its kernel stay
valid. Tensors larger than a data area go through in chunks (eager prefill and logits; decode fits whole).
"""

from __future__ import annotations

from typing import Protocol

import torch

from torpor.engine.exchange_kernel import BROADCAST, GATHER, SUM, TILE_BYTES, exchange_kernel

FLAG_BYTES = 64 << 10          # int64 flags: one per program, the last is the error word
MAX_PROGRAMS = FLAG_BYTES // 8 - 1
CPU_PROGRAMS = 4               # Triton's interpreter (tests) runs the programs one after another


class SymmetricBuffer(Protocol):
    """`size` slots of `slot_bytes`, slot r at `base + r * slot_bytes` in every rank's address space."""

    rank: int
    size: int
    slot_bytes: int

    def view(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole buffer [size * slot_bytes / itemsize] as a tensor of `dtype` (no copy)."""


class ExchangeError(RuntimeError):
    """A peer did not arrive within the kernel's wait (it died or hangs): this engine cannot run any more."""


class TensorExchange:
    def __init__(self, buffer: SymmetricBuffer) -> None:
        self.buffer = buffer
        self.rank, self.size = buffer.rank, buffer.size
        self.area_bytes = (buffer.slot_bytes - FLAG_BYTES) // 2 // 16 * 16
        device = buffer.view(torch.uint8).device
        # One program per SM: every program is resident at once, so none waits on one that never starts.
        self.num_programs = min(MAX_PROGRAMS, torch.cuda.get_device_properties(device).multi_processor_count
                                if device.type == "cuda" else CPU_PROGRAMS)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place, accumulated in fp32 in rank order (the same bits on every rank)."""
        flat = x.view(-1)
        for start, stop in self._chunks(flat):
            self._launch(flat[start:stop], flat[start:stop], SUM, 0)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into `x` of every rank, in place (same shape and dtype everywhere)."""
        flat = x.view(-1)
        for start, stop in self._chunks(flat):
            self._launch(flat[start:stop], flat[start:stop], BROADCAST, 0)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., k] on every rank -> [..., k * size], rank order."""
        x = x.contiguous()
        flat = x.view(-1)
        gathered = torch.empty(self.size, flat.numel(), dtype=x.dtype, device=x.device)
        for start, stop in self._chunks(flat):
            self._launch(flat[start:stop], gathered[:, start:stop], GATHER, flat.numel())
        k = x.shape[-1]
        return gathered.view(self.size, -1, k).permute(1, 0, 2).reshape(*x.shape[:-1], k * self.size)

    def check(self) -> None:
        """Raise ExchangeError if a wait gave up since the buffer was mapped (reads one int64: a sync)."""
        flags = self.buffer.view(torch.int64)
        index = self.rank * (self.buffer.slot_bytes // 8) + MAX_PROGRAMS
        if int(flags[index].item()):
            raise ExchangeError(f"tensor-parallel rank {self.rank}: a peer did not join a collective in time "
                                "(it died or hangs); this engine cannot run any more")

    def _chunks(self, flat: torch.Tensor) -> list[tuple[int, int]]:
        step = self.area_bytes // flat.element_size()
        return [(start, min(start + step, flat.numel())) for start in range(0, flat.numel(), step)]

    def _launch(self, x: torch.Tensor, out: torch.Tensor, op: int, out_row_stride: int) -> None:
        itemsize, slot_bytes = x.element_size(), self.buffer.slot_bytes
        exchange_kernel[(self.num_programs,)](
            x, out, self.buffer.view(x.dtype), self.buffer.view(torch.int64), x.numel(), out_row_stride, self.rank,
            slot_bytes // itemsize, slot_bytes // 8, FLAG_BYTES // itemsize, self.area_bytes // itemsize,
            MAX_PROGRAMS, SIZE=self.size, OP=op, BLOCK=TILE_BYTES // itemsize)
