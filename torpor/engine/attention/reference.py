"""Plain PyTorch paged decode attention: the fp32 ground truth the Triton kernel is tested against."""

import torch


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V, computed in fp32.

    q: [num_seqs, num_q_heads, head_dim]; k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables: [num_seqs, max_blocks_per_seq]; context_lens: [num_seqs].
    Returns fp32 [num_seqs, num_q_heads, head_dim]; a sequence with context length 0 gets zeros.
    Reads context_lens on the host, so it is for tests and CPU use, not CUDA graphs.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    queries_per_kv = num_q_heads // num_kv_heads
    out = torch.zeros(num_seqs, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    for seq, context_len in enumerate(context_lens.tolist()):
        if context_len == 0:
            continue
        positions = torch.arange(context_len, device=q.device)
        blocks = block_tables[seq].long()[positions // block_size]
        offsets = positions % block_size
        # [context_len, num_kv_heads, head_dim] -> one kv head per group of q heads
        keys = k_cache[blocks, offsets].float().repeat_interleave(queries_per_kv, dim=1)
        values = v_cache[blocks, offsets].float().repeat_interleave(queries_per_kv, dim=1)
        scores = torch.einsum("hd,thd->ht", q[seq].float(), keys) * scale  # [num_q_heads, context_len]
        out[seq] = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), values)
    return out
