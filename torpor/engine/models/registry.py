"""Architecture name (config.json `architectures[0]`) -> model class, imported lazily."""

import importlib

import torch
from torch import nn

from torpor.engine.attention.metadata import AttentionBackend
from torpor.engine.models.config import ModelConfig

MODEL_REGISTRY = {
    "LlamaForCausalLM": ("torpor.engine.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("torpor.engine.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("torpor.engine.models.llama", "LlamaForCausalLM"),
    "Qwen3MoeForCausalLM": ("torpor.engine.models.llama", "LlamaForCausalLM"),
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_REGISTRY)}")
    module_name, class_name = MODEL_REGISTRY[architecture]
    return getattr(importlib.import_module(module_name), class_name)


def build_model(
    config: ModelConfig,
    backend: AttentionBackend,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    max_model_len: int | None = None,
) -> nn.Module:
    """Allocate the model (uninitialized parameters) directly on `device` in `dtype` (default: the
    checkpoint's). Every parameter and buffer is created inside this call, so a memory tag scope
    around it captures them all. `max_model_len` bounds the RoPE table."""
    model_class = get_model_class(config.architecture)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype or config.torch_dtype)
    try:
        with torch.device(device):
            model = model_class(config, backend, max_model_len)
    finally:
        torch.set_default_dtype(previous_dtype)
    return model.eval()
