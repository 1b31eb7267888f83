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


def random_paged_decode_inputs(
    context_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    max_blocks_per_seq: int | None = None,
    poison_unused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random decode inputs laid out as the model runner does, for tests and benchmarks.

    K and V are views of one allocation (equal, non-dense strides); blocks are handed out in shuffled
    order; block tables are padded (to max_blocks_per_seq, default one more than needed) with a spare
    block; q is a slice of a wider projection, so its sequence stride is not dense. With poison_unused,
    cache slots no sequence owns hold NaN, so a kernel that reads past a context length produces NaN.
    Returns q, k_cache, v_cache, block_tables (int32), context_lens (int32).
    """
    gen = torch.Generator(device).manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 1
    order = torch.randperm(num_blocks, generator=gen, device=device).int()
    max_blocks_per_seq = max_blocks_per_seq or max(blocks_per_seq) + 1
    if max_blocks_per_seq < max(blocks_per_seq):
        raise ValueError(f"max_blocks_per_seq={max_blocks_per_seq} cannot hold a context of {max(context_lens)}")
    block_tables = order[-1].repeat(len(context_lens), max_blocks_per_seq)
    kv = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    first_block = 0
    for seq, (context_len, num_seq_blocks) in enumerate(zip(context_lens, blocks_per_seq, strict=True)):
        seq_blocks = order[first_block : first_block + num_seq_blocks]
        block_tables[seq, :num_seq_blocks] = seq_blocks
        first_block += num_seq_blocks
        positions = torch.arange(context_len, device=device)
        owned[seq_blocks[positions // block_size].long() * block_size + positions % block_size] = True
    if poison_unused:
        kv.masked_fill_(~owned.view(num_blocks, 1, block_size, 1, 1), float("nan"))
    qkv = torch.randn(
        len(context_lens), num_q_heads + 2 * num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype
    )
    context_lens_t = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return qkv[:, :num_q_heads], kv[:, 0], kv[:, 1], block_tables, context_lens_t
