"""Copying checkpoint tensors into already-allocated parameters (in place, so addresses never move).

Every weight loader ends in `copy_weight`, the one place that writes a parameter. Under
`recording_copies()` it writes nothing and records the (destination view, source view) pair instead:
run the loaders on meta tensors and the records say, without touching any data, which parameter
elements each checkpoint tensor's elements go to (fused shards, tensor-parallel slices), and every
name, shape and dtype error is raised before a byte is written (see loader.py)."""

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from torpor.engine.models.config import DTYPES

LOADABLE_DTYPES = tuple(DTYPES.values())

_recorded: ContextVar[list[tuple[torch.Tensor, torch.Tensor]] | None] = ContextVar("torpor_copies", default=None)


def copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` into `dst` in place, converting dtype and device; shapes must match exactly."""
    if src.dtype not in LOADABLE_DTYPES:
        raise ValueError(f"unsupported dtype {src.dtype} (expected bfloat16, float16 or float32)")
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: parameter has {tuple(dst.shape)}, checkpoint has {tuple(src.shape)}")
    recorded = _recorded.get()
    if recorded is not None:
        recorded.append((dst, src))
        return
    dst.copy_(src)


@contextmanager
def recording_copies() -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Within the block `copy_weight` validates and records (dst, src) instead of copying."""
    recorded: list[tuple[torch.Tensor, torch.Tensor]] = []
    token = _recorded.set(recorded)
    try:
        yield recorded
    finally:
        _recorded.reset(token)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    """Loader of parameters that are not fused: the whole tensor, no shard."""
    if shard_id is not None:
        raise ValueError(f"parameter is not fused, got shard {shard_id!r}")
    copy_weight(param.data, loaded_weight)
