"""Attention in plain PyTorch ops: the CPU path, and the reference the GPU kernels are checked against."""

import torch

from torpor.engine.attention.metadata import AttentionMetadata
from torpor.engine.gemm import CPU_ROW_MULTIPLE

KEY_CHUNK = 64  # keys per step of the prefill attention's online softmax (see causal_attention)


class TorchAttentionBackend:
    """Prefill: packed variable-length causal attention, one sequence at a time, over the cached prefix
    (if any) plus the new tokens. Decode: all sequences at once, K/V read through the block tables."""

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
        return self._decode(q, k_cache, v_cache, metadata, scale)

    def _prefill(self, q, k, v, k_cache, v_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        if metadata.cu_seqlens_q is None:
            raise ValueError("prefill attention needs cu_seqlens_q")
        out = torch.empty_like(q)
        cu_seqlens = metadata.cu_seqlens_q.tolist()
        for i, context_len in enumerate(metadata.context_lens.tolist()):
            start, end = cu_seqlens[i], cu_seqlens[i + 1]
            num_cached = context_len - (end - start)
            if num_cached == 0:  # nothing cached before: the new K/V are the whole context
                seq_k, seq_v = k[start:end], v[start:end]
            else:
                if not k_cache.numel():
                    raise ValueError("prefill over a cached prefix needs a KV cache")
                blocks = metadata.block_tables[i]
                seq_k = gather_context(k_cache, blocks, context_len)
                seq_v = gather_context(v_cache, blocks, context_len)
            out[start:end] = causal_attention(q[start:end], seq_k, seq_v, num_cached, scale)
        return out

    def _decode(self, q, k_cache, v_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        if not k_cache.numel():
            raise ValueError("decode attention needs a KV cache")
        num_seqs, num_heads, head_dim = q.shape
        dtype = q.dtype
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        max_context_len = metadata.max_context_len or int(metadata.context_lens.max())
        block_tables = metadata.block_tables[:, : -(-max_context_len // block_size)]
        # [num_seqs, max_context_len rounded up to whole blocks, num_kv_heads, head_dim]
        keys = k_cache[block_tables].flatten(1, 2).float()
        values = v_cache[block_tables].flatten(1, 2).float()
        q = q.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = torch.einsum("skgd,slkd->skgl", q, keys) * scale  # [seqs, kv_heads, groups, ctx]
        positions = torch.arange(keys.shape[1], device=q.device)
        beyond = positions[None, :] >= metadata.context_lens[:, None]  # [seqs, ctx]
        scores.masked_fill_(beyond[:, None, None, :], float("-inf"))
        out = torch.einsum("skgl,slkd->skgd", scores.softmax(dim=-1), values)
        return out.reshape(num_seqs, num_heads, head_dim).to(dtype)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first `context_len` tokens of one sequence: [context_len, num_kv_heads, head_dim]."""
    num_blocks = -(-context_len // cache.shape[1])
    return cache[block_table[:num_blocks]].flatten(0, 1)[:context_len]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int, scale: float) -> torch.Tensor:
    """q [q_len, num_heads, head_dim] attends to k/v [num_cached + q_len, num_kv_heads, head_dim];
    query i sits at position num_cached + i and sees keys 0..num_cached + i (bottom-right causal).
    Row-invariant: a query's output depends neither on how many queries came with it nor on how many keys
    follow its own, so a prompt prefilled after a cached prefix gets the bits of the same prompt prefilled
    whole, whatever the length of the prefill that computed the prefix. The query rows are padded as
    gemm.row_invariant pads a GEMM's rows (on CPU); the keys are taken KEY_CHUNK at a time (the last chunk
    padded) with an online softmax, and a chunk past a query's position leaves its max, sum and output
    exactly as they were. (PyTorch's fused CPU attention reduces a row over all the keys it is given: its
    bits depend on the key count.) The GPU's prefill runs triton_backend.prefill_attention instead."""
    q_len, groups, q_dtype = q.shape[0], q.shape[1] // k.shape[1], q.dtype
    pad = -q_len % CPU_ROW_MULTIPLE if q.device.type == "cpu" else 0
    if pad:  # extra rows repeat the last query (and its mask row); their outputs are dropped
        q = torch.cat([q, q[-1:].expand(pad, *q.shape[1:])])
    key_pad = -k.shape[0] % KEY_CHUNK
    if key_pad:  # masked for every query
        k, v = (torch.cat([t, t.new_zeros(key_pad, *t.shape[1:])]) for t in (k, v))
    # [heads, len, head_dim], float32
    q, k, v = (t.transpose(0, 1).float() for t in (q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)))
    q_pos = torch.arange(q.shape[1], device=q.device).clamp(max=q_len - 1)[:, None] + num_cached
    row_max = q.new_full((*q.shape[:2], 1), float("-inf"))
    row_sum, out = q.new_zeros((*q.shape[:2], 1)), torch.zeros_like(q)
    for start in range(0, k.shape[1], KEY_CHUNK):  # every query sees key 0: the first chunk sets a finite max
        scores = torch.bmm(q, k[:, start : start + KEY_CHUNK].transpose(1, 2)) * scale
        visible = torch.arange(start, start + KEY_CHUNK, device=q.device)[None, :] <= q_pos
        scores.masked_fill_(~visible, float("-inf"))
        new_max = torch.maximum(row_max, scores.amax(-1, keepdim=True))
        probs, rescale = torch.exp(scores - new_max), torch.exp(row_max - new_max)
        row_sum = row_sum * rescale + probs.sum(-1, keepdim=True)
        out = out * rescale + torch.bmm(probs, v[:, start : start + KEY_CHUNK])
        row_max = new_max
    return (out / row_sum)[:, :q_len].transpose(0, 1).to(q_dtype)
