"""The checkpoint's manifest: every tensor name and full shape, what an update is checked against before a
byte is written."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from torpor.engine.models.layers.loading import LOADABLE_DTYPES
from torpor.engine.models.layers.moe import EXPERT_WEIGHT, PROJECTIONS
from torpor.engine.weights.index import read_headers


# ---- checks against the engine's checkpoint ---------------------------------------------------------
@dataclass(frozen=True)
class Manifest:
    """The checkpoint's tensors: name -> full (unsharded) shape. `fused`: names an update may give for several
    checkpoint tensors at once -> (full shape, the checkpoint names it stands for): a MoE layer's experts as
    transformers >= 5 holds them (`mlp.experts.gate_up_proj` [E, 2I, H] for every expert's gate_proj and
    up_proj, `mlp.experts.down_proj` [E, H, I]), what a transformers trainer's `named_parameters()` gives."""

    shapes: dict[str, tuple[int, ...]]
    fused: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = field(default_factory=dict)

    @classmethod
    def of_checkpoint(cls, path: str) -> Manifest:
        """From the safetensors headers of the checkpoint folder `path` (no tensor data is read)."""
        shapes = {entry.name: entry.shape for entry in read_headers(path)}
        return cls(shapes, fused_expert_names(shapes))

    def covered(self, names: Iterable[str]) -> set[str]:
        """The checkpoint names that tensors named `names` (checked by `check`) cover."""
        out: set[str] = set()
        for name in names:
            out.update(self.fused[name][1] if name in self.fused else (name,))
        return out

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
            shape = self.shapes[name] if name in self.shapes else self.fused[name][0] if name in self.fused else None
            if shape is None:
                problems.append(f"unknown tensor {name!r} (not in the model's checkpoint)")
            elif tuple(tensor.shape) != shape:
                problems.append(f"{name!r} has shape {list(tensor.shape)}, the model's is {list(shape)}")
            if tensor.dtype not in LOADABLE_DTYPES:
                problems.append(f"{name!r} has dtype {tensor.dtype} (expected bfloat16, float16 or float32)")
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise ValueError(f"weight update refused, nothing was written: {shown}")


def fused_expert_names(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """`Manifest.fused` of a checkpoint holding per-expert tensors (`...mlp.experts.{e}.gate_proj.weight`): for every
    layer whose experts 0..E-1 all have their three projections, of one shape each."""
    layers: dict[str, dict[str, dict[int, tuple[int, ...]]]] = {}
    for name, shape in shapes.items():
        match = EXPERT_WEIGHT.match(name)
        if match is not None:
            prefix, expert, projection = match.groups()
            layers.setdefault(prefix, {}).setdefault(projection, {})[int(expert)] = shape
    fused = {}
    for prefix, by_projection in layers.items():
        gate, up, down = (by_projection.get(p, {}) for p in PROJECTIONS)
        experts = range(len(gate))
        if not all(set(p) == set(experts) for p in (gate, up, down)) or len({*gate.values(), *up.values()}) != 1 \
                or len(set(down.values())) != 1:
            continue
        inter, hidden = gate[0]
        fused[f"{prefix}.gate_up_proj"] = ((len(experts), 2 * inter, hidden),
                                           tuple(f"{prefix}.{e}.{p}.weight" for e in experts for p in PROJECTIONS[:2]))
        fused[f"{prefix}.down_proj"] = ((len(experts), *down[0]),
                                        tuple(f"{prefix}.{e}.down_proj.weight" for e in experts))
    return fused


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

