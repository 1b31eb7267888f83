"""Tensor-parallel state of this process (its rank, the group size) and the few collectives the layers use.

One process per rank; the default process group holds them all (gloo on CPU, NCCL on GPU). Without
`init_tensor_parallel` the process is rank 0 of 1 and every collective is the identity, so a
single-device engine never touches torch.distributed.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

_rank, _size = 0, 1


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _size


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device,
                         timeout_s: float = 120.0) -> None:
    """Join the group of `size` ranks (rendezvous at `init_method`, e.g. "tcp://127.0.0.1:PORT")."""
    global _rank, _size
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    _rank, _size = rank, size


def shutdown_tensor_parallel() -> None:
    """Leave the group (this process is rank 0 of 1 again)."""
    global _rank, _size
    if dist.is_initialized():
        dist.destroy_process_group()
    _rank, _size = 0, 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the ranks, in place (the partial outputs of row-parallel layers)."""
    if _size > 1:
        dist.all_reduce(x)
    return x


def gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., n] on every rank -> [..., n * size], rank order (vocab-sharded logits)."""
    if _size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest `value` of all ranks (e.g. the KV blocks that fit on every device)."""
    if _size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def shard_size(total: int, what: str) -> int:
    """`total` split over the ranks; a clear error when it does not divide."""
    if total % _size:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({_size})")
    return total // _size


def check_divisible(model_config, size: int) -> None:
    """Raise before any process starts when the model cannot be split over `size` ranks."""
    m = model_config
    for what, total in (("num_attention_heads", m.num_attention_heads), ("num_key_value_heads", m.num_key_value_heads),
                        ("intermediate_size", m.intermediate_size), ("vocab_size", m.vocab_size)):
        if total % size:
            raise ValueError(f"tensor_parallel_size={size}: the model's {what} ({total}) is not divisible by it")
