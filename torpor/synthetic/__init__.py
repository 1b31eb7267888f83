"""Synthetic checkpoints in the exact Hugging Face layout (no weights can be downloaded here)."""

from torpor.synthetic.generator import cached_model_path, default_model_path, make_model, preset_bytes
from torpor.synthetic.presets import PRESETS, get_preset

__all__ = ["PRESETS", "cached_model_path", "default_model_path", "get_preset", "make_model", "preset_bytes"]
