"""GPU attention: the Triton paged kernel for decode, PyTorch SDPA (flash / memory-efficient) for prefill."""

import weakref

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from torpor.engine.attention.metadata import AttentionMetadata
from torpor.engine.attention.torch_backend import causal_attention, gather_context

# Prefill SDPA kernels, in order: flash (no mask), memory-efficient (the mask over a cached prefix), math as
# the last resort. Never cuDNN attention: it builds a cuDNN graph per new sequence length (10 s of a
# 256-request run with mixed prompt lengths, measured on an H200) and holds a cuDNN handle's memory.
_PREFILL_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class TritonAttentionBackend:
    """Decode runs `paged_decode_attention` (graph-capturable: no host sync, static grid) with a workspace
    the model runner allocates in its workspace memory scope and assigns to `workspace`. Prefill runs one
    SDPA call per sequence of the packed batch over the cached prefix (if any) plus the new tokens."""

    def __init__(self) -> None:
        from torpor.engine.attention import triton_decode  # imports triton: GPU engines only

        self._decode = triton_decode.paged_decode_attention
        self.workspace: torch.Tensor | None = None
        # The host copies of one prefill's lengths, read once per step rather than once per layer.
        self._lens_of: weakref.ref | None = None  # weak: the step's tensors must not outlive it
        self._lens: tuple[list[int], list[int]] = ([], [])

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if metadata.is_prefill:
            return self._prefill(q, k, v, k_cache, v_cache, metadata, scale)
        out = torch.empty_like(q)  # [num_seqs, num_heads, head_dim]
        return self._decode(q, k_cache, v_cache, metadata.block_tables, metadata.context_lens, scale, out,
                            workspace=self.workspace)

    def _prefill(self, q, k, v, k_cache, v_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        if metadata.cu_seqlens_q is None:
            raise ValueError("prefill attention needs cu_seqlens_q")
        if self._lens_of is None or self._lens_of() is not metadata:
            self._lens_of = weakref.ref(metadata)
            self._lens = (metadata.cu_seqlens_q.tolist(), metadata.context_lens.tolist())
        out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
        with sdpa_kernel(_PREFILL_KERNELS, set_priority=True):
            self._prefill_each(q, k, v, k_cache, v_cache, metadata, scale, out)
        return out

    def _prefill_each(self, q, k, v, k_cache, v_cache, metadata: AttentionMetadata, scale: float,
                      out: torch.Tensor) -> None:
        cu_seqlens, context_lens = self._lens
        for i, context_len in enumerate(context_lens):
            start, end = cu_seqlens[i], cu_seqlens[i + 1]
            num_cached = context_len - (end - start)
            if num_cached == 0:
                seq_k, seq_v = k[start:end], v[start:end]
            else:  # the prefix is in the cache (and the new tokens were just written after it)
                blocks = metadata.block_tables[i]
                seq_k = gather_context(k_cache, blocks, context_len)
                seq_v = gather_context(v_cache, blocks, context_len)
            out[start:end] = causal_attention(q[start:end], seq_k, seq_v, num_cached, scale)
