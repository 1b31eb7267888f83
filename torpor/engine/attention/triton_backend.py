"""GPU attention: the Triton paged kernel for decode, PyTorch's memory-efficient kernel for prefill."""

import itertools
import weakref
from dataclasses import dataclass

import torch

from torpor.engine.attention.metadata import AttentionMetadata
from torpor.engine.attention.torch_backend import causal_attention, gather_context

# PyTorch's memory-efficient attention masks "causal from the bottom right" itself (custom_mask_type 2, what
# torch.nn.attention.bias.causal_lower_right dispatches to; importing that module imports torch._dynamo,
# 1.3 s of start-up). One kernel for a whole prompt and for one after a cached prefix, and row-invariant:
# flash attention splits the keys for a few queries (split-KV), so its rows' bits depend on the query count.
# Never cuDNN attention: it builds a cuDNN graph per new sequence length (10 s of a 256-request run with mixed
# prompt lengths, measured on an H200) and holds a cuDNN handle's memory.
_CAUSAL_FROM_BOTTOM_RIGHT = 2


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                      max_seqlen_q: int | None = None, max_seqlen_k: int | None = None) -> torch.Tensor:
    """q [num_queries, num_heads, head_dim] attends to k/v [num_keys, num_kv_heads, head_dim]: one sequence,
    or with cu_seqlens_q / cu_seqlens_k (int32 [num_seqs + 1], on the device) packed sequences in one call.
    Each sequence is bottom-right causal: its queries are its last keys (a cached prefix, then the new
    tokens). A row's bits depend neither on how many queries nor on how many sequences came with it."""
    if not q.is_cuda:  # Triton's interpreter runs this backend on CPU: the CPU attention, a sequence at a time
        return _one_sequence_at_a_time(q, k, v, scale, cu_seqlens_q, cu_seqlens_k)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = torch.ops.aten._efficient_attention_forward(  # [batch 1, num_queries, heads, head_dim] in and out
        q[None], k[None], v[None], bias=None, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=0.0,
        custom_mask_type=_CAUSAL_FROM_BOTTOM_RIGHT, compute_log_sumexp=False, scale=scale, seqlen_k=None)[0]
    return out[0]


def _one_sequence_at_a_time(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None) -> torch.Tensor:
    cu_q = [0, q.shape[0]] if cu_seqlens_q is None else cu_seqlens_q.tolist()
    cu_k = [0, k.shape[0]] if cu_seqlens_k is None else cu_seqlens_k.tolist()
    out = torch.empty_like(q)
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(cu_q), itertools.pairwise(cu_k), strict=True):
        out[q0:q1] = causal_attention(q[q0:q1], k[k0:k1], v[k0:k1], (k1 - k0) - (q1 - q0), scale)
    return out


@dataclass
class _PrefillStep:
    """One prefill's lengths, read to the host once per step rather than once per layer."""

    cu_seqlens: list[int]  # [num_seqs + 1] new tokens, packed
    context_lens: list[int]  # [num_seqs] cached prefix + new tokens
    any_cached: bool


class TritonAttentionBackend:
    """Decode runs `paged_decode_attention` (graph-capturable: no host sync, static grid) with a workspace
    the model runner allocates in its workspace memory scope and assigns to `workspace`. Prefill runs one
    memory-efficient attention call for the whole packed batch (`prefill_attention`): the new tokens' K/V
    as they are when nothing is cached, else every sequence's context (cached prefix from the paged cache,
    then its new tokens) packed."""

    def __init__(self) -> None:
        from torpor.engine.attention import triton_decode  # imports triton: GPU engines only

        self._decode = triton_decode.paged_decode_attention
        self._max_group_members = triton_decode.max_group_members
        self.workspace: torch.Tensor | None = None
        self._step_of: weakref.ref | None = None  # weak: the step's tensors must not outlive it
        self._step: _PrefillStep | None = None

    def decode_group_size(self, num_q_heads: int, num_kv_heads: int) -> int:
        """Sequences the decode kernel computes a shared prefix for at once (DecodeBuffers' max_group_members)."""
        return self._max_group_members(num_q_heads, num_kv_heads)

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
                            prefixes=metadata.prefixes, workspace=self.workspace)

    def _prefill(self, q, k, v, k_cache, v_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        step = self._prefill_step(metadata)
        if step.any_cached:  # every sequence's whole context, packed: [sum of context_lens, kv_heads, head_dim]
            k, v = (torch.cat([self._context(new, cache, metadata, step, i) for i in range(len(step.context_lens))])
                    for new, cache in ((k, k_cache), (v, v_cache)))
        return prefill_attention(q, k, v, scale, metadata.cu_seqlens_q, metadata.cu_seqlens_k, metadata.max_seqlen_q,
                                 metadata.max_context_len)

    @staticmethod
    def _context(new: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata, step: _PrefillStep,
                 i: int) -> torch.Tensor:
        start, end = step.cu_seqlens[i], step.cu_seqlens[i + 1]
        if step.context_lens[i] == end - start:
            return new[start:end]  # nothing cached before
        return gather_context(cache, metadata.block_tables[i], step.context_lens[i])  # new tokens already written

    def _prefill_step(self, metadata: AttentionMetadata) -> _PrefillStep:
        if metadata.cu_seqlens_q is None or metadata.cu_seqlens_k is None:
            raise ValueError("prefill attention needs cu_seqlens_q and cu_seqlens_k")
        if self._step_of is None or self._step_of() is not metadata:
            cu_seqlens, context_lens = metadata.cu_seqlens_q.tolist(), metadata.context_lens.tolist()
            any_cached = any(c != cu_seqlens[i + 1] - cu_seqlens[i] for i, c in enumerate(context_lens))
            self._step_of = weakref.ref(metadata)
            self._step = _PrefillStep(cu_seqlens, context_lens, any_cached)
        return self._step
