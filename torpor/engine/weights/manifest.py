"""The checkpoint's manifest: every tensor name and full shape, what an update is checked against before a
byte is written."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from torpor.engine.models.layers.loading import LOADABLE_DTYPES
from torpor.engine.weights.index import read_headers


# ---- checks against the engine's checkpoint ---------------------------------------------------------
@dataclass(frozen=True)
class Manifest:
    """The checkpoint's tensors: name -> full (unsharded) shape, and the names the model ignores."""

    shapes: dict[str, tuple[int, ...]]

    @classmethod
    def of_checkpoint(cls, path: str) -> Manifest:
        """From the safetensors headers of the checkpoint folder `path` (no tensor data is read)."""
        return cls({entry.name: entry.shape for entry in read_headers(path)})

    @functools.cached_property
    def max_bytes(self) -> int:
        """What one payload may map at most: twice the model in fp32 (computed once: the manifest is fixed)."""
        return 8 * sum(_numel(s) for s in self.shapes.values()) + (64 << 20)

    def check(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Every name known, every shape the checkpoint's, every dtype loadable, no name twice; raises
        ValueError listing the problems (nothing has been written yet)."""
        problems, seen = [], set()
        for name, tensor in named_tensors:
            if name in seen:
                problems.append(f"{name!r} given twice")
            seen.add(name)
            if name not in self.shapes:
                problems.append(f"unknown tensor {name!r} (not in the model's checkpoint)")
            elif tuple(tensor.shape) != self.shapes[name]:
                problems.append(f"{name!r} has shape {list(tensor.shape)}, the model's is {list(self.shapes[name])}")
            if tensor.dtype not in LOADABLE_DTYPES:
                problems.append(f"{name!r} has dtype {tensor.dtype} (expected bfloat16, float16 or float32)")
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise ValueError(f"weight update refused, nothing was written: {shown}")


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

