"""Model geometry parsed from a Hugging Face `config.json` (Llama 3, Qwen2/2.5, Qwen3, Qwen3-MoE)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torpor.engine.config import DTYPE_NAMES

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)

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
    # Mixture of experts (Qwen3-MoE); 0 / () for dense models. `moe_layers`: the decoder layers whose MLP is
    # the sparse block (every `decoder_sparse_step`-th, less `mlp_only_layers`); the others keep the dense MLP
    # of `intermediate_size`. No shared experts (Qwen3-MoE has none).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    moe_layers: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

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
        """Read `<path>/config.json` (or `path` itself when it is the file). ValueError naming the file
        for one that is not a JSON object or holds a missing, mistyped or impossible value."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        try:
            config = cls.from_dict(read_json_object(file))
        except ValueError as e:
            raise ValueError(f"{file}: {e}") from None
        # generation_config.json may list more end-of-sequence ids (e.g. a chat model's end-of-turn)
        generation_file = file.parent / "generation_config.json"
        if generation_file.is_file():
            try:
                extra = _id_tuple(read_json_object(generation_file).get("eos_token_id"), "eos_token_id")
            except ValueError as e:
                raise ValueError(f"{generation_file}: {e}") from None
            eos_ids = config.eos_token_ids + tuple(i for i in extra if i not in config.eos_token_ids)
            config = dataclasses.replace(config, eos_token_ids=eos_ids)
        return config

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """ValueError naming the key for a missing, mistyped or impossible value (sizes must be positive
        integers, rope parameters positive numbers)."""
        arch = _architecture(d)
        num_heads = _positive_int(d, "num_attention_heads")
        num_kv_heads = _positive_int(d, "num_key_value_heads", num_heads)
        hidden_size = _positive_int(d, "hidden_size")
        head_dim = _positive_int(d, "head_dim", hidden_size // num_heads)
        if head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary embedding halves), got {head_dim}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r} (only 'silu')")
        if d.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
        attention_bias = bool(d.get("attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        rope_theta, rope_scaling = _parse_rope(d)
        num_layers = _positive_int(d, "num_hidden_layers")
        return cls(
            architecture=arch,
            hidden_size=hidden_size,
            intermediate_size=_positive_int(d, "intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=_positive_int(d, "vocab_size"),
            rms_norm_eps=_number(d, "rms_norm_eps", 1e-6, positive=False),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_positive_int(d, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_proj_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            torch_dtype=_parse_dtype(d.get("torch_dtype") or d.get("dtype") or "float32"),
            bos_token_id=next(iter(_id_tuple(d.get("bos_token_id"), "bos_token_id")), None),
            eos_token_ids=_id_tuple(d.get("eos_token_id"), "eos_token_id"),
            **(_parse_moe(d, num_layers) if arch in MOE_ARCHITECTURES else {}),
        )


def read_json_object(file: Path) -> dict[str, Any]:
    """The JSON object in `file`; ValueError (not naming the file) for one that is not valid UTF-8 JSON,
    nests past Python's recursion limit, or is not an object."""
    try:
        value = json.loads(file.read_text())
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object (a {type(value).__name__})")
    return value


def _positive_int(d: dict[str, Any], key: str, default: int | None = None) -> int:
    """d[key], a positive integer; `default` (when given) stands in for a missing, null or 0 value, as
    Hugging Face reads them."""
    value = d.get(key)
    if default is not None and value in (None, 0):
        value = default
    if value is None:
        raise ValueError(f"{key} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key} must be a positive integer, got {repr(value)[:50]}")
    return value


def _number(d: dict[str, Any], key: str, default: float | None = None, positive: bool = True) -> float:
    """d[key] (`default` when missing or null), a finite number: positive, or with `positive=False` not
    negative."""
    value = d.get(key)
    value = default if value is None else value
    if value is None:
        raise ValueError(f"{key} is missing")
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0
            or (positive and value == 0)):
        raise ValueError(f"{key} must be a finite {'positive' if positive else 'non-negative'} number, "
                         f"got {repr(value)[:50]}")
    return float(value)


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    if not isinstance(archs, list) or len(archs) != 1:
        raise ValueError(f"config.json must name exactly one architecture, got {repr(archs)[:100]}")
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ValueError(f"unsupported architecture {repr(archs[0])[:100]}; supported: {supported}")
    return archs[0]


def _parse_rope(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 writes `rope_parameters` (theta included); older files `rope_theta` + `rope_scaling`.
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"rope_scaling must be an object, got {str(rope)[:50]}")
    theta = _number(d if d.get("rope_theta") is not None else rope, "rope_theta", 10000.0)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_scaling type {str(rope_type)[:50]!r} (supported: default, llama3)")
    low, high = _number(rope, "low_freq_factor"), _number(rope, "high_freq_factor")
    if high <= low:
        raise ValueError(f"rope_scaling: high_freq_factor ({high}) must exceed low_freq_factor ({low})")
    return theta, RopeScaling(
        factor=_number(rope, "factor"),
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=_positive_int(rope, "original_max_position_embeddings"),
    )


def _parse_moe(d: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The MoE fields of a Qwen3-MoE config (transformers >= 5 writes `num_local_experts` for `num_experts`)."""
    experts_key = "num_experts" if d.get("num_experts") is not None else "num_local_experts"
    num_experts = _positive_int(d, experts_key)
    top_k = _positive_int(d, "num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) exceeds {experts_key} ({num_experts})")
    step = _positive_int(d, "decoder_sparse_step", 1)
    dense = d.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers
                                              for i in dense):
        raise ValueError(f"mlp_only_layers must be a list of layer indices in [0, {num_layers}), got {str(dense)[:50]}")
    norm = d.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ValueError(f"norm_topk_prob must be true or false, got {norm!r}")
    # transformers' Qwen3MoeDecoderLayer: sparse where not mlp-only and (layer + 1) % decoder_sparse_step == 0
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return dict(num_experts=num_experts, num_experts_per_tok=top_k,
                moe_intermediate_size=_positive_int(d, "moe_intermediate_size"), norm_topk_prob=norm,
                moe_layers=layers)


def _parse_dtype(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise ValueError(f"unsupported torch_dtype {str(name)[:50]!r}; supported: {', '.join(DTYPES)}")
    return DTYPES[name]


def _id_tuple(ids: object, key: str) -> tuple[int, ...]:
    """A token id or list of them (None: none); ValueError for anything else."""
    ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{key} must be a token id or a list of them, got {str(ids)[:50]}")
    return tuple(ids)
