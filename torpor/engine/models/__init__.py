"""Decoder models (Llama 3, Qwen2/2.5, Qwen3, Qwen3-MoE) and their configuration."""

from torpor.engine.models.config import ModelConfig
from torpor.engine.models.registry import build_model, get_model_class

__all__ = ["ModelConfig", "build_model", "get_model_class"]
