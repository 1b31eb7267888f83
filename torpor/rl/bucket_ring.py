"""The flat buffers one push flattens its buckets into, reused in turn.

A push in SGLang's 512 MiB buckets is ~30 requests for an 8B model. Flattening each bucket into memory of its own
makes every request share new memory with the engine: a new shared-memory file on CPU (a round trip to torch's
`torch_shm_manager`, 3–10 ms on a loaded machine), a new CUDA IPC mapping to open and close on GPU. A push holds at
most `in_flight + 2` requests' buckets at once (`WeightPusher.push_buckets`), so that many buffers, reused in
turn, carry the whole push: each is shared once, and the engine, told by the push's headers how many buffers the
trainer cycles through, keeps each opened mapping until the push ends instead of opening one per request
(`torpor.server.weight_pipeline`). A buffer is written again only after the request that last carried it was
answered, i.e. after the engine copied it.
"""

from __future__ import annotations

import torch


class BucketRing:
    """`slots` flat uint8 buffers per device, handed out in turn by `take`: each the size of the first bucket it
    held, grown to `bucket_bytes` (or an oversized bucket's size) when a larger one comes."""

    def __init__(self, slots: int, bucket_bytes: int) -> None:
        if slots < 1:
            raise ValueError(f"a bucket ring needs at least one slot, got {slots}")
        self.slots, self.bucket_bytes = slots, bucket_bytes
        self._buffers: dict[torch.device, list[torch.Tensor]] = {}
        self._taken: dict[torch.device, int] = {}

    def take(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of the next buffer on `device` (1-D uint8): the caller must no longer need what it
        held `slots` takes ago. A bucket larger than its slot's buffer gets a larger buffer there. CPU buffers are
        in shared memory (the `file_system` strategy), so each is shared with the engine once."""
        device = torch.device(device)
        buffers = self._buffers.setdefault(device, [])
        index = self._taken.get(device, 0) % self.slots
        self._taken[device] = self._taken.get(device, 0) + 1
        if index == len(buffers):  # its first bucket's size: the engine maps a buffer whole, and a model smaller
            buffers.append(self._allocate(device, nbytes))  # than a bucket must not look larger than it is
        elif buffers[index].numel() < nbytes:  # once per slot at most: then it holds any bucket but an oversized one
            buffers[index] = self._allocate(device, max(nbytes, self.bucket_bytes))
        return buffers[index][:nbytes]

    def _allocate(self, device: torch.device, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if device.type == "cpu":
            torch.multiprocessing.set_sharing_strategy("file_system")  # a file an unrelated process can open
            buffer.share_memory_()
        return buffer

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for buffers in self._buffers.values() for b in buffers)

    def close(self) -> None:
        """Let the buffers go (the engine keeps none of them past the push's last request)."""
        self._buffers.clear()
        self._taken.clear()
