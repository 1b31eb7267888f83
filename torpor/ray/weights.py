"""The trainer's end of a fleet's weights update group: rank 0 of one process group across every replica's ranks.

    group = GroupBroadcaster(master_address, master_port, world_size=1 + num_replicas * tp, device="cuda")
    # at the same time, the driver: fleet.init_weights_update_group(master_address, master_port, 1, world_size, ...)
    group.open()
    # each push, at the same time: fleet.update_weights_from_distributed(*group.spec(named), group_name=...)
    group.broadcast(named)

NCCL on GPU, gloo on CPU (`torpor.engine.weights.transport`, the same groups `torpor.rl.DistributedPusher`
hosts). Every replica's ranks receive each broadcast at once: one broadcast tree over the whole group.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from torpor.engine.weights.transport import broadcast, destroy_group_handle, open_update_group


def spec(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], list[str], list[list[int]]]:
    """names, dtypes ("bfloat16", ...) and shapes of `named_tensors`: the arguments of
    `update_weights_from_distributed`, in the order `broadcast` sends them."""
    named = list(named_tensors)
    return ([n for n, _ in named], [str(t.dtype).removeprefix("torch.") for _, t in named],
            [list(t.shape) for _, t in named])


class GroupBroadcaster:
    """Hosts the group's store at `master_address:master_port` and is its rank 0 (of `world_size`), broadcasting
    from `device`. `open()` returns once every rank joined (within `timeout` seconds, else WeightTransferError
    naming the ranks that did not)."""

    def __init__(self, master_address: str, master_port: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str | None = None,
                 device: str | torch.device = "cpu", timeout: float = 120.0) -> None:
        self.master_address, self.master_port, self.world_size = master_address, master_port, world_size
        self.group_name, self.backend, self.device, self.timeout = group_name, backend, torch.device(device), timeout
        self.group = None

    def open(self) -> None:
        if self.group is not None:
            raise RuntimeError(f"weights update group {self.group_name!r} is open already")
        self.group = open_update_group(self.master_address, self.master_port, 0, self.world_size, self.group_name,
                                       self.backend, self.device, self.timeout)

    def broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Every tensor, in order, to every rank of the group; returns the seconds it took."""
        if self.group is None:
            raise RuntimeError(f"weights update group {self.group_name!r} is not open: call open() first")
        start = time.perf_counter()
        for _, tensor in named_tensors:
            broadcast(self.group, tensor.detach().to(self.device).contiguous())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def close(self) -> None:
        """Leave the group (the replicas leave it with `fleet.destroy_weights_update_group`)."""
        if self.group is not None:
            destroy_group_handle(self.group)
            self.group = None
