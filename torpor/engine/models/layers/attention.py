"""Paged attention layer: stores the new K/V in the cache, then lets a pluggable backend do the math."""

import torch
from torch import nn

from torpor.engine.attention.metadata import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    """`k_cache` / `v_cache` ([num_blocks, block_size, num_kv_heads, head_dim], contiguous) are plain
    attributes, not buffers: the model runner assigns its views of the KV allocation to them."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim], k/v [num_tokens, num_kv_heads, head_dim] -> like q."""
        if self.k_cache.numel():
            store_kv(k, v, self.k_cache, self.v_cache, metadata.slot_mapping)
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, metadata, self.scale)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter the new tokens' K/V to their slots. No host sync (CUDA-graph safe); every slot must be
    valid, so padded batch entries must point at a scratch slot."""
    # view(), not reshape(): a non-contiguous cache must fail loudly instead of writing into a copy.
    k_cache.view(-1, k.shape[1], k.shape[2]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, v.shape[1], v.shape[2]).index_copy_(0, slot_mapping, v)
