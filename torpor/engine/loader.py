"""Load Hugging Face safetensors checkpoints into a model's existing parameters, in place.

Parameters are never re-allocated (every tensor is `copy_`-ed into the parameter it belongs to), so
the same calls serve the first load, a reload after the weights' memory was discarded, and in-process
weight updates: parameter addresses, and CUDA graphs captured on them, stay valid."""

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from torpor.engine.models.layers.loading import default_weight_loader

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Load every parameter of `model` from the checkpoint folder `path`; every parameter must be
    covered and every checkpoint tensor must belong to one. Also recomputes, in place, the buffers no
    checkpoint holds (`model.reset_buffers()`), so this restores a model whose weights were discarded."""
    load_named_tensors(model, iter_checkpoint(path), strict=True)
    if hasattr(model, "reset_buffers"):
        model.reset_buffers()


def load_named_tensors(
    model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = False
) -> int:
    """Copy tensors named as in the Hugging Face checkpoint (e.g. `model.layers.0.self_attn.q_proj.weight`)
    into `model`. With `strict`, raise if any parameter (or fused shard) received nothing; otherwise a
    partial update is fine (weights pushed in chunks). Returns the number of tensors loaded.
    Buffers are not touched: after discarding the weights, call `model.reset_buffers()` once."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    is_ignored = getattr(model, "is_ignored_weight", lambda name: False)
    loaded: set[tuple[str, object]] = set()
    with torch.no_grad():
        for name, tensor in named_tensors:
            if is_ignored(name):
                continue
            param_name, shard_id = _resolve(name, packed)
            if param_name not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")
            param = params[param_name]
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                weight_loader(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
            loaded.add((param_name, shard_id))
    if strict:
        expected = {(n, s) for n, p in params.items() for s in getattr(p, "shard_ids", (None,))}
        missing = sorted(_hf_name(n, s, packed) for n, s in expected - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")
    return len(loaded)


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: the shards listed by the index, or the single file."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint folder {path} does not exist")
    if (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text()).get("weight_map")
        if not weight_map:
            raise ValueError(f"{path / INDEX_FILE} has no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"shard {file.name} listed in {INDEX_FILE} is missing from {path}")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


def iter_checkpoint(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the checkpoint, one at a time (never all in memory)."""
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def _resolve(name: str, packed: dict[str, tuple[str, object]]) -> tuple[str, object]:
    """Checkpoint name -> (parameter name, shard id); e.g. q_proj -> (qkv_proj, "q")."""
    for module, (fused, shard_id) in packed.items():
        if f".{module}." in name:
            return name.replace(f".{module}.", f".{fused}."), shard_id
    return name, None


def _hf_name(param_name: str, shard_id: object, packed: dict[str, tuple[str, object]]) -> str:
    for module, (fused, shard) in packed.items():
        if shard == shard_id and f".{fused}." in param_name:
            return param_name.replace(f".{fused}.", f".{module}.")
    return param_name
