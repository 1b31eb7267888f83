"""What the attention layers need to know about a batch, and the interface of attention backends."""

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class AttentionMetadata:
    """One forward step. Prefill packs the new tokens of every sequence into one [num_tokens] batch
    (a sequence may already have `context_len - query_len` tokens in the cache); decode has exactly
    one new token per sequence. Slot of a token = block_id * block_size + offset_in_block."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's K/V goes to
    context_lens: torch.Tensor  # [num_seqs] int32: tokens of each seq in the cache after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    cu_seqlens_q: torch.Tensor | None  # [num_seqs + 1] int32, prefill only (packed varlen query)
    max_seqlen_q: int = 0  # prefill only
    max_context_len: int = 0
    cu_seqlens_k: torch.Tensor | None = None  # [num_seqs + 1] int32, prefill only: the contexts, packed
    # decode on GPU: shared prompt prefixes and the groups of rows that share one (triton_decode.DecodePrefixes)
    prefixes: Any = None


class AttentionBackend(Protocol):
    """Computes attention once the new K/V are in the paged cache (the layer writes them first).

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] (the new tokens);
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
    Returns [num_tokens, num_heads, head_dim].
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...
