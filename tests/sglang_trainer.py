"""The trainer's side of a weights update group as SGLang's users form it: the torch calls SGLang's
`init_custom_process_group` (python/sglang/srt/utils/common.py) makes, which SGLang's tests, slime and OpenRLHF run on
rank 0, then a broadcast of each tensor from rank 0. SGLang itself is not importable here (its utilities import
its GPU dependencies), so the same calls are made directly: torch's `tcp://` rendezvous, a `PrefixStore` named after
the group, torch's `_new_process_group_helper` with no global ranks, the group's ranks registered as themselves."""

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous


def trainer_group(port: int, world_size: int, group_name: str, timeout_s: float = 60, backend: str = "gloo",
                  address: str = "127.0.0.1", rank: int = 0):
    """Rank `rank` (0: the trainer) of `group_name` at `address:port`: returns once every one of `world_size` ranks
    joined."""
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {r: r for r in range(world_size)}
    return group


def broadcast_all(group, tensors) -> None:
    """Every tensor from rank 0, in order."""
    for tensor in tensors:
        dist.broadcast(tensor, src=0, group=group)
