"""PyTorch references and random inputs for the kernel tests (tests/cpu and tests/gpu) and benchmarks.

The fused-kernel references run the model code's PyTorch path (`RMSNorm._norm`, SiluAndMul's ops,
`apply_rotary`) directly, never the module's `forward`: on CUDA that would dispatch to the fused kernel
under test itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torpor.engine.models.layers.norm import RMSNorm
from torpor.engine.models.layers.rotary import apply_rotary


class _Norm:
    """RMSNorm's own normalization (`_norm`) on given weights, without building a module."""

    _norm = RMSNorm._norm

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.eps = weight, eps


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), as RMSNorm.forward's PyTorch path."""
    h = x + residual
    return _Norm(weight, eps)._norm(h), h


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """norm(x), as RMSNorm.forward's PyTorch path."""
    return _Norm(weight, eps)._norm(x)


def qk_norm_rope_reference(
    qkv: torch.Tensor,
    cos_sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> None:
    """qk_norm_rope_ (in place, same arguments) by LlamaAttention.forward's ops: split, view, q_norm/k_norm,
    apply_rotary; the results are copied back into qkv's q and k columns."""
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    if q_weight is not None:
        q, k = _Norm(q_weight, eps)._norm(q), _Norm(k_weight, eps)._norm(k)
    q, k = apply_rotary(q, cos_sin), apply_rotary(k, cos_sin)
    qkv[:, :q_size] = q.view(num_tokens, q_size)
    qkv[:, q_size : q_size + kv_size] = k.view(num_tokens, kv_size)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, SiluAndMul's PyTorch path: gate_up [N, 2 * I] -> [N, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


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
