"""The experts of a MoE layer on CUDA, in Triton: what `moe.experts_reference` computes, with the same rounding
points, without a host sync (CUDA-graph safe) and with every buffer sized by the batch alone.

1. `align` (`_count_kernel` then `_place_kernel`, one program per expert; `align_by_expert` is their PyTorch
   reference): the token-slots (token * k + j) sorted by expert, each expert's run padded to whole blocks of
   BLOCK_M, and the expert of every block. The number of blocks depends on the routing, so the grid is launched
   for the most there can be (`max_blocks`); blocks past the used ones exit.
2. `_gate_up_kernel`: per block of BLOCK_M slots of one expert and BLOCK_N intermediate columns, the gate and up
   GEMMs over the hidden dimension (tl.dot, fp32 accumulators), then silu(gate) * up rounded as SiluAndMul.
3. `_down_kernel`: the down GEMM over the intermediate dimension, rounded to the dtype, times the slot's routing
   weight (rounded again: transformers' `current_hidden_states * top_k_weights`).
4. `_sum_kernel`: each token's k terms added in ascending expert id (the slots' order, see `moe.by_expert_id`),
   every partial sum rounded to the dtype (transformers' `index_add_` per expert). No atomics: deterministic.

Batch invariance (a row's bits whatever else is in the batch, so prefix caching on or off gives the same tokens):
the tile shapes, warps and reduction loops are constants of the dtype, never of the batch; a slot's output is a
dot product of its own row with the expert's weights over K tiles in a fixed order (tl.dot rows do not depend on
the tile's other rows), at whatever row of whatever block it lands; the k-term sum is the token's own. Tokens are
processed in chunks of CHUNK_TOKENS (which bounds the [slots, H] buffers of a long prefill); chunking changes no
row either.

Importing this module does not import triton (see fused.py): the kernels are jitted on first use. They call
fused.py's device functions (the dtype rounding, libdevice's exp). Off CUDA they run in Triton's interpreter
(tests/cpu/test_fused_moe_interpret.py).
"""

from __future__ import annotations  # keeps the kernels' `tl.constexpr` annotations unevaluated until then

from typing import Any

import torch

from torpor.engine.lazy_jit import LazyJit
from torpor.engine.models.layers import fused

triton: Any = None
tl: Any = None
_kernels = LazyJit(globals())
_jit = _kernels.jit

CHUNK_TOKENS = 4096
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) per dtype: fixed, whatever the batch (see the docstring). fp32 runs
# exact fp32 dots (`input_precision="ieee"`, FMA units), smaller tiles for the registers.
_TILES = {torch.bfloat16: (64, 64, 64, 4), torch.float16: (64, 64, 64, 4), torch.float32: (32, 32, 32, 4)}
_SUM_BLOCK = 1024
_ALIGN_CHUNK = 1024  # slots an align program scans per step


@_jit
def _count_kernel(ids_ptr, counts_ptr, num_slots, CHUNK: tl.constexpr):
    """counts[e] = the slots routed to expert e (one program per expert)."""
    expert = tl.program_id(0)
    count = tl.zeros((CHUNK,), dtype=tl.int32)
    for start in range(0, num_slots, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        count += (tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1) == expert).to(tl.int32)
    tl.store(counts_ptr + expert, tl.sum(count, axis=0))


@_jit
def _place_kernel(
    ids_ptr,  # [num_slots]: the expert of each slot
    counts_ptr,  # [NUM_EXPERTS] from _count_kernel
    slots_ptr,  # [num_blocks * BLOCK_M] int32, filled with num_slots (padding) before the launch
    block_expert_ptr,  # [num_blocks] int32
    num_slots,
    num_blocks,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS: tl.constexpr,  # next power of two >= NUM_EXPERTS
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program per expert: its slots, in slot order, from the first row of its first block (the blocks of the
    experts before it come first), and its blocks' entries of block_expert; program 0 also marks the unused
    blocks (NUM_EXPERTS)."""
    expert = tl.program_id(0)
    experts = tl.arange(0, EXPERTS)
    blocks = (tl.load(counts_ptr + experts, mask=experts < NUM_EXPERTS, other=0) + BLOCK_M - 1) // BLOCK_M
    first_block = tl.sum(tl.where(experts < expert, blocks, 0), axis=0)
    own_blocks = tl.sum(tl.where(experts == expert, blocks, 0), axis=0)
    seen = 0
    for start in range(0, num_slots, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        match = (tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1) == expert).to(tl.int32)
        rank = seen + tl.cumsum(match, axis=0) - match  # earlier slots of this expert
        tl.store(slots_ptr + first_block * BLOCK_M + rank, offs, mask=match > 0)
        seen += tl.sum(match, axis=0)
    total = tl.sum(blocks, axis=0)
    for start in range(0, num_blocks, CHUNK):
        ids = start + tl.arange(0, CHUNK)
        own = (ids >= first_block) & (ids < first_block + own_blocks)
        unused = (ids >= total) & (ids < num_blocks) & (tl.zeros((CHUNK,), dtype=tl.int32) + expert == 0)
        value = tl.where(own, expert + tl.zeros((CHUNK,), dtype=tl.int32), NUM_EXPERTS)
        tl.store(block_expert_ptr + ids, value, mask=own | unused)


@_jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,  # [E, 2 * INTER, HIDDEN]: each expert's gate rows, then its up rows
    out_ptr,  # [num_slots, INTER]
    slots_ptr,  # [max blocks * BLOCK_M] int32: slot of each sorted row, num_slots where padding
    block_expert_ptr,  # [max blocks] int32: the expert of each block, NUM_EXPERTS past the used blocks
    num_slots,
    x_stride,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACCURATE: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    """silu(x W_gate^T) * (x W_up^T) of BLOCK_M slots of one expert, BLOCK_N intermediate columns."""
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < NUM_EXPERTS:
        slots = tl.load(slots_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slots < num_slots
        tokens = (slots // TOP_K).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < INTER
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + tokens[:, None] * x_stride + ks[None, :]
        g_ptrs = w_ptr + expert.to(tl.int64) * (2 * INTER * HIDDEN) + cols[None, :] * HIDDEN + ks[:, None]
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            k_ok = k0 + ks < HIDDEN
            a = tl.load(a_ptrs + k0, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            g = tl.load(g_ptrs + k0, mask=w_mask, other=0.0)
            u = tl.load(g_ptrs + INTER * HIDDEN + k0, mask=w_mask, other=0.0)
            if SOFT_BF16:  # the interpreter's dot cannot take bf16: the same exact products, in fp32
                a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
            acc_g = tl.dot(a, g, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, u, acc_u, input_precision="ieee")
        dtype = out_ptr.dtype.element_ty
        gate = fused._to_dtype(acc_g, dtype, SOFT_BF16).to(tl.float32)
        up = fused._to_dtype(acc_u, dtype, SOFT_BF16).to(tl.float32)
        act = fused._to_dtype(tl.math.div_rn(gate, 1.0 + fused._exp(-gate, ACCURATE)), dtype, SOFT_BF16)
        out = fused._to_dtype(act.to(tl.float32) * up, dtype, SOFT_BF16)
        out_ptrs = out_ptr + slots.to(tl.int64)[:, None] * INTER + cols[None, :]
        tl.store(out_ptrs, out, mask=valid[:, None] & col_ok[None, :])


@_jit
def _down_kernel(
    h_ptr,  # [num_slots, INTER]
    w_ptr,  # [E, HIDDEN, INTER]
    weights_ptr,  # [num_slots]: each slot's routing weight
    out_ptr,  # [num_slots, HIDDEN]
    slots_ptr,
    block_expert_ptr,
    num_slots,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    """weight * (h W_down^T) of BLOCK_M slots of one expert, BLOCK_N hidden columns, each product rounded."""
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < NUM_EXPERTS:
        slots = tl.load(slots_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slots < num_slots
        rows = slots.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < HIDDEN
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = h_ptr + rows[:, None] * INTER + ks[None, :]
        b_ptrs = w_ptr + expert.to(tl.int64) * (HIDDEN * INTER) + cols[None, :] * INTER + ks[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            k_ok = k0 + ks < INTER
            a = tl.load(a_ptrs + k0, mask=valid[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if SOFT_BF16:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        dtype = out_ptr.dtype.element_ty
        y = fused._to_dtype(acc, dtype, SOFT_BF16).to(tl.float32)
        w = tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)
        out = fused._to_dtype(y * w[:, None], dtype, SOFT_BF16)
        tl.store(out_ptr + rows[:, None] * HIDDEN + cols[None, :], out, mask=valid[:, None] & col_ok[None, :])


@_jit
def _sum_kernel(
    terms_ptr,  # [num_tokens * TOP_K, HIDDEN]
    out_ptr,
    out_stride,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    """out[t] = ((term_0 + term_1) + term_2) + ..., each sum rounded to the dtype."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    first = terms_ptr + token * TOP_K * HIDDEN + cols
    dtype = out_ptr.dtype.element_ty
    acc = tl.load(first, mask=mask, other=0.0)
    for j in tl.static_range(1, TOP_K):
        term = tl.load(first + j * HIDDEN, mask=mask, other=0.0)
        acc = fused._to_dtype(acc.to(tl.float32) + term.to(tl.float32), dtype, SOFT_BF16)
    tl.store(out_ptr + token * out_stride + cols, acc, mask=mask)


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """The most BLOCK_M blocks `num_slots` slots take when each expert's run is padded to whole blocks: every
    expert that has a slot (at most min(E, slots)) wastes at most block_m - 1 rows."""
    return -(-(num_slots + min(num_experts, num_slots) * (block_m - 1)) // block_m)


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (slots [max_blocks * block_m] int32, block_expert [max_blocks] int32): the slots t * k + j
    sorted by expert (stable: ascending slot within an expert), each expert's run starting at a block; padding
    rows hold T * k. block_expert[b] is the expert of block b, num_experts for the unused blocks. Device ops of
    fixed sizes only (no host sync); the reference of `align`, which does it in three launches."""
    num_slots = ids.numel()
    device = ids.device
    flat = ids.reshape(-1)
    sorted_experts, order = torch.sort(flat, stable=True)
    starts = torch.searchsorted(sorted_experts, torch.arange(num_experts + 1, device=device, dtype=flat.dtype))
    counts = starts[1:] - starts[:-1]
    blocks = (counts + block_m - 1) // block_m
    block_ends = torch.cumsum(blocks, 0)
    padded_starts = (block_ends - blocks) * block_m
    rank = torch.arange(num_slots, device=device) - starts[sorted_experts]  # place within its expert's run
    nblocks = max_blocks(num_slots, num_experts, block_m)
    slots = torch.full((nblocks * block_m,), num_slots, dtype=torch.int32, device=device)
    slots.scatter_(0, padded_starts[sorted_experts] + rank, order.to(torch.int32))
    block_ids = torch.arange(nblocks, device=device, dtype=block_ends.dtype)
    return slots, torch.searchsorted(block_ends, block_ids, right=True).to(torch.int32)


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What `align_by_expert` returns, in three launches (a fill, `_count_kernel`, `_place_kernel`)."""
    _kernels.load()
    num_slots = ids.numel()
    nblocks = max_blocks(num_slots, num_experts, block_m)
    slots = torch.full((nblocks * block_m,), num_slots, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(nblocks, dtype=torch.int32, device=ids.device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    flat = ids.reshape(-1)
    _count_kernel[(num_experts,)](flat, counts, num_slots, CHUNK=_ALIGN_CHUNK, num_warps=4)
    _place_kernel[(num_experts,)](flat, counts, slots, block_expert, num_slots, nblocks, NUM_EXPERTS=num_experts,
                                  EXPERTS=fused._next_power_of_2(num_experts), BLOCK_M=block_m, CHUNK=_ALIGN_CHUNK,
                                  num_warps=4)
    return slots, block_expert


def _check(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
           weights: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in _TILES or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, H] of {tuple(_TILES)}, contiguous in H, got {x.dtype} {tuple(x.shape)}")
    num_experts, two_inter, hidden = gate_up.shape
    if hidden != x.shape[1] or two_inter % 2 or down.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"gate_up [E, 2I, H] {tuple(gate_up.shape)} and down [E, H, I] {tuple(down.shape)} do not "
                         f"fit x {tuple(x.shape)}")
    for name, w in (("gate_up", gate_up), ("down", down)):
        if w.dtype != x.dtype or not w.is_contiguous():
            raise ValueError(f"{name} must be contiguous and of x's dtype, got {w.dtype}")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape or weights.dtype != x.dtype:
        raise ValueError(f"ids and weights must be [T, k] (weights of x's dtype), got {tuple(ids.shape)} and "
                         f"{weights.dtype} {tuple(weights.shape)}")


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """As `moe.experts_reference(x, gate_up, down, ids, weights)` (ids/weights [T, k] sorted by ascending id per
    row): x [T, H], gate_up [E, 2I, H], down [E, H, I] -> [T, H]."""
    _check(x, gate_up, down, ids, weights)
    out = torch.empty_like(x)
    for start in range(0, x.shape[0], CHUNK_TOKENS):
        end = min(x.shape[0], start + CHUNK_TOKENS)
        _chunk(x[start:end], gate_up, down, ids[start:end], weights[start:end], out[start:end])
    return out


def _chunk(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
           out: torch.Tensor) -> None:
    options = fused._launch_options(x)  # imports triton (fused.py's device functions with it) on first use
    _kernels.load()
    num_tokens, top_k = ids.shape
    num_experts, hidden, inter = down.shape
    block_m, block_n, block_k, num_warps = _TILES[x.dtype]
    # In Triton's interpreter (CPU tensors, tests) 2 x E interpreted programs cost more than the reference's ops,
    # which give the same result (tests/cpu/test_fused_moe_interpret.py)
    slots, block_expert = (align if x.is_cuda else align_by_expert)(ids, num_experts, block_m)
    num_slots, nblocks = ids.numel(), block_expert.shape[0]
    h = torch.empty((num_slots, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(nblocks, -(-inter // block_n))](
        x, gate_up, h, slots, block_expert, num_slots, x.stride(0),
        TOP_K=top_k, HIDDEN=hidden, INTER=inter, NUM_EXPERTS=num_experts,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, **options,
    )
    terms = torch.empty((num_slots, hidden), dtype=x.dtype, device=x.device)
    _down_kernel[(nblocks, -(-hidden // block_n))](
        h, down, weights.reshape(-1), terms, slots, block_expert, num_slots,
        HIDDEN=hidden, INTER=inter, NUM_EXPERTS=num_experts, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, SOFT_BF16=options["SOFT_BF16"], enable_fp_fusion=False,
    )
    block = min(_SUM_BLOCK, fused._next_power_of_2(hidden))
    _sum_kernel[(num_tokens, -(-hidden // block))](
        terms, out, out.stride(0), TOP_K=top_k, HIDDEN=hidden, BLOCK=block, num_warps=4,
        SOFT_BF16=options["SOFT_BF16"], enable_fp_fusion=False,
    )
