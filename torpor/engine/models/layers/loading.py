"""Copying checkpoint tensors into already-allocated parameters (in place, so addresses never move)."""

import torch

from torpor.engine.models.config import DTYPES

LOADABLE_DTYPES = tuple(DTYPES.values())


def copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` into `dst` in place, converting dtype and device; shapes must match exactly."""
    if src.dtype not in LOADABLE_DTYPES:
        raise ValueError(f"unsupported dtype {src.dtype} (expected bfloat16, float16 or float32)")
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: parameter has {tuple(dst.shape)}, checkpoint has {tuple(src.shape)}")
    dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    """Loader of parameters that are not fused: the whole tensor, no shard."""
    if shard_id is not None:
        raise ValueError(f"parameter is not fused, got shard {shard_id!r}")
    copy_weight(param.data, loaded_weight)
