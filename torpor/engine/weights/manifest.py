"""The checkpoint's manifest: every tensor name and full shape, what an update is checked against before a
byte is written."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from torpor.engine.models.config import ModelConfig
from torpor.engine.models.layers.loading import LOADABLE_DTYPES
from torpor.engine.models.layers.moe import EXPERT_WEIGHT, PROJECTIONS
from torpor.engine.weights.index import read_headers

TensorSpec = tuple[str, tuple[int, ...]]  # a checkpoint tensor's name and full shape


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

    @classmethod
    def of_config(cls, config: ModelConfig) -> Manifest:
        """The checkpoint `config` describes (engines on dummy weights: a trainer may then send every tensor)."""
        shapes = dict(weight_specs(config))
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


def weight_specs(config: ModelConfig) -> list[TensorSpec]:
    """Every tensor of a checkpoint of `config` (Hugging Face names) with its shape, in checkpoint order: what
    the synthetic checkpoints write, and the manifest of an engine on dummy weights."""
    h, d = config.hidden_size, config.head_dim
    specs: list[TensorSpec] = [("model.embed_tokens.weight", (config.vocab_size, h))]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        specs.append((p + "input_layernorm.weight", (h,)))
        for proj, size in (("q_proj", config.q_size), ("k_proj", config.kv_size), ("v_proj", config.kv_size)):
            specs.append((f"{p}self_attn.{proj}.weight", (size, h)))
            if config.qkv_bias:
                specs.append((f"{p}self_attn.{proj}.bias", (size,)))
        specs.append((p + "self_attn.o_proj.weight", (h, config.q_size)))
        if config.o_proj_bias:
            specs.append((p + "self_attn.o_proj.bias", (h,)))
        if config.qk_norm:
            specs += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
        specs.append((p + "post_attention_layernorm.weight", (h,)))
        if i in config.moe_layers:
            specs += _expert_specs(config, p)
            continue
        for proj, shape in (("gate_proj", (config.intermediate_size, h)), ("up_proj", (config.intermediate_size, h)),
                            ("down_proj", (h, config.intermediate_size))):  # fmt: skip
            specs.append((f"{p}mlp.{proj}.weight", shape))
            if config.mlp_bias:
                specs.append((f"{p}mlp.{proj}.bias", shape[:1]))
    specs.append(("model.norm.weight", (h,)))
    if not config.tie_word_embeddings:
        specs.append(("lm_head.weight", (config.vocab_size, h)))
    return specs


def _expert_specs(config: ModelConfig, prefix: str) -> list[TensorSpec]:
    """A sparse layer's MLP as Qwen3-MoE checkpoints hold it: the router, then each expert's three projections."""
    h, i = config.hidden_size, config.moe_intermediate_size
    specs: list[TensorSpec] = [(prefix + "mlp.gate.weight", (config.num_experts, h))]
    for e in range(config.num_experts):
        expert = f"{prefix}mlp.experts.{e}."
        specs += [(expert + "gate_proj.weight", (i, h)), (expert + "up_proj.weight", (i, h)),
                  (expert + "down_proj.weight", (h, i))]
    return specs
