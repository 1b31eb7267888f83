"""Weights without a checkpoint (`EngineConfig.load_format="dummy"`, vLLM's name): every parameter drawn in place on
its device, for benchmarks of geometries whose checkpoint is too large to write beside everything else (Qwen3-30B-A3B
is 61 GB of bf16). The model folder needs only config.json and the tokenizer (`torpor make-model --config-only`).

The values follow the synthetic generator's distributions (torpor/synthetic/generator.py: norm weights 1 + N(0, 0.05),
biases N(0, 0.02), matrices N(0, 1 / in_features)), from a generator of the parameter's device seeded by (seed,
parameter name): the same seed gives the same values at every call, so a reload after a level-2 sleep restores them
bit for bit. They are not the synthetic checkpoint's values (another generator, another device)."""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from torpor.engine.weights.loader import parameters_of


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter of `model` in place (addresses unchanged) and recompute its buffers."""
    for name, param in parameters_of(model).items():
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        generator = torch.Generator(param.device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        if name.endswith("norm.weight"):
            param.normal_(1.0, 0.05, generator=generator)
        elif name.endswith(".bias"):
            param.normal_(0.0, 0.02, generator=generator)
        else:
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
    if hasattr(model, "reset_buffers"):
        model.reset_buffers()
