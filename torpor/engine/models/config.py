"""Model geometry parsed from a Hugging Face `config.json` (Llama 3, Qwen2/2.5, Qwen3)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torpor.engine.config import DTYPE_NAMES

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # name -> torch dtype


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 (`rope_type: llama3`) frequency scaling, the only scaling the engine supports."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always has q/k/v biases; Llama/Qwen3 follow `attention_bias`
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: per-head RMSNorm on q and k before RoPE
    torch_dtype: torch.dtype
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    @property
    def num_kv_groups(self) -> int:
        """Query heads sharing one KV head (GQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `<path>/config.json` (or `path` itself when it is the file)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        config = cls.from_dict(json.loads(file.read_text()))
        # generation_config.json may list more end-of-sequence ids (e.g. a chat model's end-of-turn)
        generation_file = file.parent / "generation_config.json"
        if generation_file.is_file():
            extra = _id_tuple(json.loads(generation_file.read_text()).get("eos_token_id"))
            eos_ids = config.eos_token_ids + tuple(i for i in extra if i not in config.eos_token_ids)
            config = dataclasses.replace(config, eos_token_ids=eos_ids)
        return config

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        arch = _architecture(d)
        num_heads = d["num_attention_heads"]
        num_kv_heads = d.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r} (only 'silu')")
        if d.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
        attention_bias = bool(d.get("attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        rope_theta, rope_scaling = _parse_rope(d)
        return cls(
            architecture=arch,
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            vocab_size=d["vocab_size"],
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_proj_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=_parse_dtype(d.get("torch_dtype") or d.get("dtype") or "float32"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_id_tuple(d.get("eos_token_id")),
        )


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    if len(archs) != 1:
        raise ValueError(f"config.json must name exactly one architecture, got {archs!r}")
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ValueError(f"unsupported architecture {archs[0]!r}; supported: {supported}")
    return archs[0]


def _parse_rope(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 writes `rope_parameters` (theta included); older files `rope_theta` + `rope_scaling`.
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: default, llama3)")
    return theta, RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )


def _parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unsupported torch_dtype {name!r}; supported: {', '.join(DTYPES)}")
    return DTYPES[name]


def _id_tuple(ids: int | list[int] | None) -> tuple[int, ...]:
    return () if ids is None else tuple(ids) if isinstance(ids, list) else (ids,)
