"""Synthetic checkpoint presets: real Hugging Face geometries (config.json values of the published
models) and tiny variants of each architecture for tests."""

from dataclasses import dataclass
from typing import Any

# ChatML, as the Qwen models use it.
CHATML_TEMPLATE = r"""{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}"""

# The Llama 3 header format.
LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"""


@dataclass(frozen=True)
class SpecialTokens:
    """Special tokens (content, id offset from the first special id) and how the tokenizer uses them."""

    special_tokens: tuple[tuple[str, int], ...]
    bos_token: str | None  # the tokenizer's bos (None: the tokenizer adds none)
    eos_token: str  # the tokenizer's eos: ends an assistant turn
    pad_token: str
    config_bos_token: str  # config.json bos_token_id
    config_eos_tokens: tuple[str, ...]  # config.json eos_token_id
    chat_template: str

    @property
    def span(self) -> int:
        """Ids the special tokens occupy, holes included."""
        return max(offset for _, offset in self.special_tokens) + 1


CHATML = SpecialTokens(
    special_tokens=(("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2)),
    bos_token=None,
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    config_bos_token="<|endoftext|>",
    config_eos_tokens=("<|im_end|>",),
    chat_template=CHATML_TEMPLATE,
)
LLAMA3 = SpecialTokens(
    special_tokens=(
        ("<|begin_of_text|>", 0),
        ("<|end_of_text|>", 1),
        ("<|start_header_id|>", 6),
        ("<|end_header_id|>", 7),
        ("<|eom_id|>", 8),
        ("<|eot_id|>", 9),
    ),
    bos_token="<|begin_of_text|>",
    eos_token="<|eot_id|>",
    pad_token="<|end_of_text|>",
    config_bos_token="<|begin_of_text|>",
    config_eos_tokens=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
    chat_template=LLAMA3_TEMPLATE,
)


@dataclass(frozen=True)
class Preset:
    name: str
    config: dict[str, Any]  # config.json without token ids and dtype (the generator fills them)
    chat_format: SpecialTokens
    special_token_start: int | None = None  # None: the special tokens end the vocab (tiny models)
    base_vocab_size: int = 1024  # byte-level BPE tokens learnt from the corpus (<= 1293 possible); generated
    # word pieces fill the rest of a real geometry's vocabulary (tokenizer_builder.py)

    @property
    def first_special_id(self) -> int:
        return self.special_token_start or self.config["vocab_size"] - self.chat_format.span

    @property
    def tokenizer_vocab_size(self) -> int:
        """Tokens learnt from the corpus; for tiny models they and the special ids fill the vocab exactly."""
        return self.base_vocab_size if self.special_token_start else self.first_special_id


def _llama(**geometry: Any) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "use_cache": True,
        **geometry,
    }


def _qwen2(**geometry: Any) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "use_cache": True,
        "use_sliding_window": False,
        **geometry,
    }


def _qwen3(**geometry: Any) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "use_cache": True,
        "use_sliding_window": False,
        **geometry,
    }


def _qwen3_moe(**geometry: Any) -> dict[str, Any]:
    return {
        **_qwen3(**geometry),
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        **geometry,
    }


def _geometry(hidden, intermediate, layers, heads, kv_heads, vocab, max_pos, tie, **extra) -> dict[str, Any]:
    return {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": max_pos,
        "tie_word_embeddings": tie,
        **extra,
    }


PRESETS = {
    p.name: p
    for p in (
        Preset(
            "qwen3-0.6b",
            _qwen3(**_geometry(1024, 3072, 28, 16, 8, 151936, 40960, True, head_dim=128, max_window_layers=28)),
            CHATML,
            151643,
        ),
        Preset(
            "qwen3-8b",
            _qwen3(**_geometry(4096, 12288, 36, 32, 8, 151936, 40960, False, head_dim=128, max_window_layers=36)),
            CHATML,
            151643,
        ),
        Preset("llama-3.1-8b", _llama(**_geometry(4096, 14336, 32, 32, 8, 128256, 131072, False)), LLAMA3, 128000),
        Preset(
            "qwen2.5-1.5b",
            _qwen2(**_geometry(1536, 8960, 28, 12, 2, 151936, 32768, True, max_window_layers=21, sliding_window=32768)),
            CHATML,
            151643,
        ),
        Preset(
            "qwen3-30b-a3b",
            _qwen3_moe(**_geometry(2048, 6144, 48, 32, 4, 151936, 40960, False, head_dim=128, max_window_layers=48,
                                   num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)),
            CHATML,
            151643,
        ),
        # Tiny models: a few hundred KB, one per architecture. head_dim != hidden / heads on purpose.
        Preset("tiny", _qwen3(**_geometry(64, 128, 2, 4, 2, 1024, 4096, True, head_dim=32)), CHATML),
        Preset("tiny-llama", _llama(**_geometry(64, 160, 2, 4, 2, 1024, 16384, False)), LLAMA3),
        Preset("tiny-qwen2", _qwen2(**_geometry(64, 128, 2, 4, 2, 1024, 4096, True)), CHATML),
        # 8 experts, top 2, layer 1 dense (mlp_only_layers): both MLP paths in three layers.
        Preset("tiny-moe", _qwen3_moe(**_geometry(64, 96, 3, 4, 2, 1024, 4096, False, head_dim=32, num_experts=8,
                                                  num_experts_per_tok=2, moe_intermediate_size=48,
                                                  mlp_only_layers=[1])), CHATML),
    )
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
    return PRESETS[name]
