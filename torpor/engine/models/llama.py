"""One decoder for Llama 3, Qwen2/2.5, Qwen3 and Qwen3-MoE; the differences are config flags (qkv bias, qk norm,
tied embeddings, RoPE scaling, the sparse layers). Module and parameter names follow the Hugging Face
checkpoints, except the fused `qkv_proj` and `gate_up_proj` (see `packed_modules_mapping`) and the experts,
fused per layer as transformers >= 5 holds them (`mlp.experts.gate_up_proj` / `down_proj`; a checkpoint's
per-expert names map onto them: `resolve_weight_name`)."""

import functools
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from torpor.engine.attention.metadata import AttentionBackend, AttentionMetadata
from torpor.engine.gemm import linear
from torpor.engine.models.config import ModelConfig
from torpor.engine.models.layers import fused
from torpor.engine.models.layers.activation import SiluAndMul
from torpor.engine.models.layers.attention import Attention
from torpor.engine.models.layers.embedding import VocabEmbedding, gather_logits
from torpor.engine.models.layers.linear import Linear, MergedLinear, QKVLinear, RowParallelLinear
from torpor.engine.models.layers.moe import EXPERT_WEIGHT, PROJECTIONS, SparseMoeBlock
from torpor.engine.models.layers.norm import RMSNorm
from torpor.engine.models.layers.rotary import RotaryEmbedding, apply_rotary


def ignored_weight(name: str, *, tied: bool) -> bool:
    """Checkpoint tensors with no parameter in the model (`tied`: the LM head is the embedding) and safe to skip."""
    return "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight")


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.qkv_proj = QKVLinear(
            config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads,
            config.qkv_bias,
        )
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim, (self.q_size, self.kv_size, _) = config.head_dim, self.qkv_proj.output_sizes
        self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, config.o_proj_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, backend)

    def forward(self, hidden: torch.Tensor, cos_sin: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [num_tokens, q_size + 2 * kv_size]
        if fused.fused_available(qkv):  # CUDA: q/k norm and rotary in one Triton kernel, in place
            norm_weights = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
            eps = self.q_norm.eps if self.q_norm is not None else 0.0
            fused.qk_norm_rope_(qkv, cos_sin, self.num_heads, self.num_kv_heads, self.head_dim, *norm_weights, eps)
            q, k, v = self._split_heads(qkv)
        else:
            q, k, v = self._split_heads(qkv)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, cos_sin), apply_rotary(k, cos_sin)
        out = self.attn(q, k, v, metadata)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.view(num_tokens, self.q_size))

    def _split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views q [T, num_heads, head_dim], k and v [T, num_kv_heads, head_dim] of qkv."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        num_tokens = qkv.shape[0]
        return (q.view(num_tokens, self.num_heads, self.head_dim), k.view(num_tokens, self.num_kv_heads, self.head_dim),
                v.view(num_tokens, self.num_kv_heads, self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], config.mlp_bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, config.mlp_bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if layer in config.moe_layers:
            self.mlp: nn.Module = SparseMoeBlock(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                                 config.moe_intermediate_size, config.norm_topk_prob)
        else:
            self.mlp = LlamaMLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos_sin, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, backend, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        cos_sin = self.rotary_emb(positions)  # computed once, shared by every layer
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos_sin, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. Build it under the target device and default dtype (see `build_model`);
    parameters are allocated empty and filled by `torpor.engine.weights.loader.load_weights`."""

    # checkpoint module name -> (fused module name, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, object]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_model_len: int | None = None) -> None:
        super().__init__()
        self.config = config
        max_positions = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        self.model = LlamaModel(config, backend, max_positions)
        # Tied embeddings: no separate head, the logits reuse the embedding table.
        head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, shard="column")
        self.lm_head = head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final-normed hidden states [num_tokens, hidden_size]."""
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size]."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return gather_logits(linear(hidden, weight)).float()  # vocab-sharded under tensor parallelism

    def reset_buffers(self) -> None:
        """Recompute the buffers that checkpoints do not hold (the RoPE table), in place."""
        self.model.rotary_emb.reset_buffers()

    def is_ignored_weight(self, name: str) -> bool:
        """Checkpoint tensors that have no parameter here and are safe to skip."""
        return ignored_weight(name, tied=self.lm_head is None)

    def ignored_weights(self) -> Callable[[str], bool]:
        """`is_ignored_weight` as a function that does not keep the model alive (the weight receiver holds it)."""
        return functools.partial(ignored_weight, tied=self.lm_head is None)

    def resolve_weight_name(self, name: str) -> tuple[str, object]:
        """Checkpoint name -> (parameter name, shard id): `experts.{e}.gate_proj.weight` -> (`experts.gate_up_proj`,
        ("gate_proj", e)), `down_proj` -> (`experts.down_proj`, ("down_proj", e)); q/k/v and gate/up of the dense
        layers by `packed_modules_mapping`; any other name is its parameter's, whole (shard None)."""
        expert = EXPERT_WEIGHT.match(name)
        if expert is not None:
            prefix, index, projection = expert.groups()
            fused_name = "down_proj" if projection == "down_proj" else "gate_up_proj"
            return f"{prefix}.{fused_name}", (projection, int(index))
        for module, (fused_module, shard_id) in self.packed_modules_mapping.items():
            if f".{module}." in name:
                return name.replace(f".{module}.", f".{fused_module}."), shard_id
        return name, None

    def checkpoint_name(self, param_name: str, shard_id: object) -> str:
        """The checkpoint name of a parameter's shard (the inverse of `resolve_weight_name`), for error messages."""
        if isinstance(shard_id, tuple) and shard_id[0] in PROJECTIONS:
            return f"{param_name.rsplit('.', 1)[0]}.{shard_id[1]}.{shard_id[0]}.weight"
        for module, (fused_module, shard) in self.packed_modules_mapping.items():
            if shard == shard_id and f".{fused_module}." in param_name:
                return param_name.replace(f".{fused_module}.", f".{module}.")
        return param_name

    @property
    def moe_blocks(self) -> list[SparseMoeBlock]:
        """The sparse MLP blocks, in layer order (empty for a dense model)."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
