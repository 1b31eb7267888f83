"""Paged-attention decode in Triton: one query token per sequence, split-K ("flash decoding").

Phase 1 runs one program per (sequence, kv head, split). It reads its slice of the sequence's
context once, for all q heads of that kv head together (grouped-query attention), and writes a
partial output and the log-sum-exp of its scores to a workspace. Phase 2 merges the splits of
each (sequence, q head) in a fixed order, so results are bit-reproducible (no atomics).

Shared prefixes (`DecodePrefixes`): the n samples of a GRPO prompt, and prompts found in the prefix cache,
hold the same KV blocks for their prompt. A call may give each sequence a prefix length (its prompt's full
blocks) and groups of sequences with the same prefix blocks; then phase 1 also runs, per group, kv head and
prefix split, one program for all members' query rows at once (a tile of up to prefix_block_m rows), so the
prefix is read once per group instead of once per sample, and each sequence's own programs read only its
tokens after the prefix. A row's arithmetic depends on its prefix length, its tile's shape and the split
counts, never on its group: a sequence alone (prefix caching off: its own copy of the blocks) gets the same
bits as among its group's members (a tl.dot row does not depend on the other rows of its tile; checked on
an H200). Measured at the GRPO shape: docs/engine.md.

The grid and workspace size depend only on static quantities (num_seqs, heads, max_blocks_per_seq,
SM count); the split of each sequence's actual context is computed inside the kernel. Nothing
synchronizes with the host, so the whole call can be captured in a CUDA graph.
"""

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_PROGRAMS_PER_SM = 2  # phase-1 programs wanted per SM: enough loads in flight to saturate HBM
_MAX_SPLITS = 128
_MIN_SPLIT_TOKENS = 64  # no more splits than max context / this: tiny splits cost more than they save
# Query rows of a prefix tile at least: the own programs' tile, 4 members of qwen3-8b's 4 q heads per kv head, 8 of
# qwen3-0.6b's 2. Measured on an H200 at the GRPO shape: 32 rows read the shared prefix half as often but cost
# every sequence alone (prefix caching off, or unique prompts) 19% over the kernel without prefixes.
_PREFIX_ROWS = 16
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_SUPPORTED_DTYPES = tuple(_TL_DTYPES)


@triton.jit
def _attend(
    q,  # [ROWS, HEAD_DIM] in DOT_DTYPE
    k_cache_ptr,
    v_cache_ptr,
    block_table,  # pointer to the block-table row whose blocks hold tokens [start, end)
    start,
    end,
    kv_head,
    scale_log2,
    cache_stride_block,
    cache_stride_token,
    cache_stride_head,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax of q's rows over tokens [start, end) of one kv head, BLOCK_N tokens at a time from
    `start`. Returns the unnormalized output [ROWS, HEAD_DIM], the running max and sum [ROWS] (base 2).
    A row's result depends only on its own query, the tokens and the constexprs (a tl.dot row does not
    depend on the other rows of its tile: checked on an H200, scripts/probe_decode_step.py --part dot-rows)."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    row_max = tl.full([ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for chunk_start in range(start, end, BLOCK_N):
        tokens = chunk_start + offs_n  # [BLOCK_N]
        token_mask = tokens < end
        blocks = tl.load(block_table + tokens // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)
        # [BLOCK_N, HEAD_DIM] element offsets of these tokens' K (and V: the caches share strides)
        in_block = tokens % BLOCK_SIZE
        kv_offsets = (
            blocks[:, None] * cache_stride_block
            + in_block[:, None] * cache_stride_token
            + kv_head * cache_stride_head
            + offs_d[None, :]
        )
        k = tl.load(k_cache_ptr + kv_offsets, mask=token_mask[:, None], other=0.0).to(DOT_DTYPE)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [ROWS, BLOCK_N]
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        # Online softmax; every chunk has at least one valid token, so new_max is finite.
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        probs = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=token_mask[:, None], other=0.0).to(DOT_DTYPE)
        acc = acc * rescale[:, None] + tl.dot(probs.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        row_max = new_max
    return acc, row_max, row_sum


@triton.jit
def _store_partial(
    partial_out_ptr, lse_ptr, acc, row_max, row_sum, seqs, q_heads, rows_mask, split,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, TOTAL_SPLITS: tl.constexpr,
):
    """One split's normalized output and log-sum-exp per row (sequence `seqs`, head `q_heads`) into the
    workspace [num_seqs, NUM_Q_HEADS, TOTAL_SPLITS, HEAD_DIM + lse]."""
    normalized = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]  # empty split: zeros, not NaN
    rows = (seqs * NUM_Q_HEADS + q_heads) * TOTAL_SPLITS + split
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(partial_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], normalized, mask=rows_mask[:, None])
    # A non-empty split has row_sum >= 1; an empty one has row_max = -inf, hence lse = -inf.
    tl.store(lse_ptr + rows, row_max + tl.log2(tl.maximum(row_sum, 1.0)), mask=rows_mask)


@triton.jit
def _prefix_program(
    group, kv_head, split, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, prefix_lens_ptr, group_starts_ptr,
    group_members_ptr, partial_out_ptr, lse_ptr, scale_log2, q_stride_seq, q_stride_head, cache_stride_block,
    cache_stride_token, cache_stride_head, bt_stride_seq,
    NUM_Q_HEADS: tl.constexpr, QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PREFIX_SPLITS: tl.constexpr, TOTAL_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Split `split` of group `group`'s shared prefix [0, prefix_len), for every member's query rows at once
    from the leader's (first member's) blocks: the prefix is read once per group. An empty group does nothing."""
    first = tl.load(group_starts_ptr + group)
    last = tl.load(group_starts_ptr + group + 1)
    if first < last:
        # Rows of the query tile: member * QUERIES_PER_KV + query head within this kv head.
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        member = offs_m // QUERIES_PER_KV
        rows_mask = member < last - first
        seqs = tl.load(group_members_ptr + first + member, mask=rows_mask, other=0).to(tl.int64)
        leader = tl.load(group_members_ptr + first).to(tl.int64)
        prefix_len = tl.load(prefix_lens_ptr + leader)
        q_heads = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
        q = tl.load(
            q_ptr + seqs[:, None] * q_stride_seq + q_heads[:, None] * q_stride_head + offs_d[None, :],
            mask=rows_mask[:, None],
            other=0.0,
        ).to(DOT_DTYPE)  # [BLOCK_M, HEAD_DIM]
        # Each split an equal, BLOCK_N-aligned share of the prefix: a function of prefix_len alone, so a row is
        # computed the same in a group of one (prefix caching off) as among the members of its group.
        split_len = tl.cdiv(tl.cdiv(prefix_len, PREFIX_SPLITS), BLOCK_N) * BLOCK_N
        start = split * split_len
        end = tl.minimum(start + split_len, prefix_len)
        acc, row_max, row_sum = _attend(
            q, k_cache_ptr, v_cache_ptr, block_tables_ptr + leader * bt_stride_seq, start, end, kv_head,
            scale_log2, cache_stride_block, cache_stride_token, cache_stride_head,
            BLOCK_M, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_DTYPE, DOT_PRECISION)
        _store_partial(partial_out_ptr, lse_ptr, acc, row_max, row_sum, seqs, q_heads, rows_mask, split,
                       NUM_Q_HEADS, HEAD_DIM, TOTAL_SPLITS)


@triton.jit
def _own_program(
    seq, kv_head, own_split, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, prefix_lens_ptr,
    out_ptr, partial_out_ptr, lse_ptr, scale_log2, q_stride_seq, q_stride_head, cache_stride_block,
    cache_stride_token, cache_stride_head, bt_stride_seq, out_stride_seq, out_stride_head,
    NUM_Q_HEADS: tl.constexpr, QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PREFIX_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Split `own_split` of sequence `seq`'s own tokens [prefix_len, context_len) (its whole context when the
    call has no prefixes), for the q heads of one kv head."""
    TOTAL_SPLITS: tl.constexpr = PREFIX_SPLITS + NUM_SPLITS
    context_len = tl.load(context_lens_ptr + seq)
    own_start = tl.load(prefix_lens_ptr + seq) if PREFIX_SPLITS > 0 else context_len * 0
    # Each split takes an equal, BLOCK_N-aligned share of the own tokens; late splits may be empty.
    split_len = tl.cdiv(tl.cdiv(context_len - own_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = own_start + own_split * split_len
    end = tl.minimum(start + split_len, context_len)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    head_mask = offs_h < QUERIES_PER_KV  # BLOCK_H pads the group up to a tl.dot-friendly size
    q_heads = kv_head * QUERIES_PER_KV + offs_h
    q = tl.load(
        q_ptr + seq * q_stride_seq + q_heads[:, None] * q_stride_head + offs_d[None, :],
        mask=head_mask[:, None],
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_H, HEAD_DIM]
    acc, row_max, row_sum = _attend(
        q, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * bt_stride_seq, start, end, kv_head, scale_log2,
        cache_stride_block, cache_stride_token, cache_stride_head,
        BLOCK_H, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_DTYPE, DOT_PRECISION)
    if TOTAL_SPLITS == 1:
        normalized = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]  # empty: zeros, not NaN
        tl.store(
            out_ptr + seq * out_stride_seq + q_heads[:, None] * out_stride_head + offs_d[None, :],
            normalized.to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None],
        )
    else:
        _store_partial(partial_out_ptr, lse_ptr, acc, row_max, row_sum, seq + offs_h * 0, q_heads, head_mask,
                       PREFIX_SPLITS + own_split, NUM_Q_HEADS, HEAD_DIM, TOTAL_SPLITS)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    prefix_lens_ptr,
    group_starts_ptr,
    group_members_ptr,
    out_ptr,
    partial_out_ptr,
    lse_ptr,
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    q_stride_seq,
    q_stride_head,
    cache_stride_block,
    cache_stride_token,
    cache_stride_head,
    bt_stride_seq,
    out_stride_seq,
    out_stride_head,
    NUM_Q_HEADS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PREFIX_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Phase 1. Grid (num_seqs, num_kv_heads, PREFIX_SPLITS + NUM_SPLITS): program (g, h, s < PREFIX_SPLITS)
    computes prefix split s of group g (`_prefix_program`), program (i, h, s >= PREFIX_SPLITS) own split
    s - PREFIX_SPLITS of sequence i (`_own_program`). Without prefixes (PREFIX_SPLITS == 0) the group pointers
    are never read."""
    pid = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if PREFIX_SPLITS > 0:
        if split < PREFIX_SPLITS:
            _prefix_program(
                pid, kv_head, split, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, prefix_lens_ptr,
                group_starts_ptr, group_members_ptr, partial_out_ptr, lse_ptr, scale_log2, q_stride_seq,
                q_stride_head, cache_stride_block, cache_stride_token, cache_stride_head, bt_stride_seq,
                NUM_Q_HEADS, QUERIES_PER_KV, HEAD_DIM, BLOCK_SIZE, PREFIX_SPLITS, PREFIX_SPLITS + NUM_SPLITS,
                BLOCK_M, BLOCK_N, DOT_DTYPE, DOT_PRECISION)
        else:
            _own_program(
                pid, kv_head, split - PREFIX_SPLITS, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                context_lens_ptr, prefix_lens_ptr, out_ptr, partial_out_ptr, lse_ptr, scale_log2, q_stride_seq,
                q_stride_head, cache_stride_block, cache_stride_token, cache_stride_head, bt_stride_seq,
                out_stride_seq, out_stride_head, NUM_Q_HEADS, QUERIES_PER_KV, HEAD_DIM, BLOCK_SIZE, NUM_SPLITS,
                PREFIX_SPLITS, BLOCK_H, BLOCK_N, DOT_DTYPE, DOT_PRECISION)
    else:
        _own_program(
            pid, kv_head, split, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
            prefix_lens_ptr, out_ptr, partial_out_ptr, lse_ptr, scale_log2, q_stride_seq, q_stride_head,
            cache_stride_block, cache_stride_token, cache_stride_head, bt_stride_seq, out_stride_seq,
            out_stride_head, NUM_Q_HEADS, QUERIES_PER_KV, HEAD_DIM, BLOCK_SIZE, NUM_SPLITS, 0, BLOCK_H, BLOCK_N,
            DOT_DTYPE, DOT_PRECISION)


@triton.jit
def _decode_reduce_kernel(
    partial_out_ptr,
    lse_ptr,
    out_ptr,
    out_stride_seq,
    out_stride_head,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    first_row = (seq * NUM_Q_HEADS + head) * NUM_SPLITS
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + first_row + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # context length 0: all splits empty
    weights = tl.exp2(lse - lse_max)  # [BLOCK_S]: 0 for empty and padding splits
    total = tl.sum(weights, axis=0)
    # All splits at once rather than a loop: one round of loads in flight; the reduction order is fixed at
    # compile time, so the result is still bit-reproducible.
    partial = tl.load(
        partial_out_ptr + (first_row + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=(offs_s < NUM_SPLITS)[:, None],
        other=0.0,
    )  # [BLOCK_S, HEAD_DIM]
    out = tl.sum(partial * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    out_ptr += seq * out_stride_seq + head * out_stride_head
    tl.store(out_ptr + offs_d, out.to(out_ptr.dtype.element_ty))


def _launch_config(head_dim: int, dtype: torch.dtype) -> dict[str, int]:
    """Tokens per inner-loop step (K and V tiles of BLOCK_N x head_dim), warps and pipeline stages.

    Picked so that ptxas reports no register spills for sm_90 (fp32 dots run on FMA units, not tensor cores).
    """
    if dtype == torch.float32:
        return {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_N": 64 if head_dim <= 128 else 32, "num_warps": 4, "num_stages": 2}


def prefix_block_m(queries_per_kv: int) -> int:
    """Query rows of a prefix tile: members x queries_per_kv, padded. Fixed per model (never per batch): a row's
    bits depend on its tile's shape, so a sequence alone and in a group must use the same one."""
    return max(_PREFIX_ROWS, triton.next_power_of_2(queries_per_kv))


def max_group_members(num_q_heads: int, num_kv_heads: int) -> int:
    """The most sequences one prefix tile computes together (larger groups are cut into groups of this size)."""
    queries_per_kv = num_q_heads // num_kv_heads
    return prefix_block_m(queries_per_kv) // queries_per_kv


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # Triton interpreter on CPU: a small grid keeps it fast


def num_decode_splits(
    num_seqs: int, num_kv_heads: int, max_blocks_per_seq: int, block_size: int, device: torch.device
) -> int:
    """Splits per sequence so the phase-1 grid fills the device; from static quantities only."""
    max_useful = triton.cdiv(max_blocks_per_seq * block_size, _MIN_SPLIT_TOKENS)
    wanted = triton.cdiv(_PROGRAMS_PER_SM * _num_sms(torch.device(device)), num_seqs * num_kv_heads)
    return max(1, min(wanted, max_useful, _MAX_SPLITS))


def _workspace_numel(num_seqs: int, num_q_heads: int, head_dim: int, num_splits: int) -> int:
    # fp32 partial outputs [num_seqs, num_q_heads, num_splits, head_dim] then lse [..., num_splits]
    return 0 if num_splits == 1 else num_seqs * num_q_heads * num_splits * (head_dim + 1)


def decode_workspace_shape(
    max_num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_blocks_per_seq: int,
    block_size: int,
    device: torch.device,
    prefixes: bool = False,
) -> tuple[int]:
    """Shape of a flat fp32 workspace serving every batch size from 1 to max_num_seqs (with `prefixes`:
    calls that pass shared prefixes, whose splits add up)."""

    def splits(n: int) -> int:  # a shared prefix gets as many splits as the own tokens by default
        return num_decode_splits(n, num_kv_heads, max_blocks_per_seq, block_size, device) * (2 if prefixes else 1)

    return (max(_workspace_numel(n, num_q_heads, head_dim, splits(n)) for n in range(1, max_num_seqs + 1)),)


def alloc_decode_workspace(
    max_num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_blocks_per_seq: int,
    block_size: int,
    device: torch.device,
    prefixes: bool = False,
) -> torch.Tensor:
    """Allocate the decode workspace (call inside the model runner's workspace memory scope)."""
    shape = decode_workspace_shape(
        max_num_seqs, num_q_heads, num_kv_heads, head_dim, max_blocks_per_seq, block_size, device, prefixes
    )
    return torch.empty(shape, dtype=torch.float32, device=device)


# Kept for the life of the process, one per size: a captured CUDA graph may still point at any of them.
_cached_workspaces: dict[tuple[torch.device, int], torch.Tensor] = {}


def _get_workspace(workspace: torch.Tensor | None, numel: int, device: torch.device) -> torch.Tensor:
    if workspace is None:
        workspace = _cached_workspaces.get((device, numel))
        if workspace is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "paged_decode_attention: no workspace while capturing a CUDA graph; pass "
                    "workspace=alloc_decode_workspace(...) or run this shape eagerly first"
                )
            workspace = torch.empty(numel, dtype=torch.float32, device=device)
            _cached_workspaces[(device, numel)] = workspace
    if workspace.dtype != torch.float32 or workspace.device != device or not workspace.is_contiguous():
        raise ValueError(f"workspace must be a contiguous float32 tensor on {device}")
    if workspace.numel() < numel:
        raise ValueError(f"workspace has {workspace.numel()} elements, this call needs {numel}")
    return workspace


def _check_inputs(q, k_cache, v_cache, block_tables, context_lens, out) -> None:
    if q.dim() != 3 or out.shape != q.shape:
        raise ValueError(
            f"q and out must both be [num_seqs, num_q_heads, head_dim], got {tuple(q.shape)}, {tuple(out.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim] "
            f"with equal strides, got {tuple(k_cache.shape)} {k_cache.stride()}, "
            f"{tuple(v_cache.shape)} {v_cache.stride()}"
        )
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if q.dtype not in _SUPPORTED_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"q, k_cache, v_cache must share one of {_SUPPORTED_DTYPES}, "
            f"got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if k_cache.shape[3] != head_dim or head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(
            f"head_dim must be a power of two in [16, 256] shared by q and the caches, "
            f"got q {head_dim}, cache {k_cache.shape[3]}"
        )
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be int32 [num_seqs={num_seqs}, max_blocks_per_seq], "
            f"got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if context_lens.dtype != torch.int32 or context_lens.shape != (num_seqs,):
        raise ValueError(
            f"context_lens must be int32 [num_seqs={num_seqs}], got {context_lens.dtype} {tuple(context_lens.shape)}"
        )
    for name, t in (
        ("q", q),
        ("out", out),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_tables", block_tables),
        ("context_lens", context_lens),
    ):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


@dataclass(frozen=True)
class DecodePrefixes:
    """Shared prefixes of a decode batch (int32 device tensors): `prefix_lens` [num_seqs], each sequence's
    prefix length (0: none; at most its context length); groups partition the sequences: group g's members are
    `group_members[group_starts[g]:group_starts[g + 1]]` (`group_starts` [num_seqs + 1], non-decreasing, the
    unused groups at the end empty), at most max_group_members(...) each, all with the same prefix length and the
    same blocks over it (the caller's promise: the kernel reads every member's prefix from the first one's
    blocks). Sequence i's result does not depend on its group: alone it is computed the same way."""

    prefix_lens: torch.Tensor
    group_starts: torch.Tensor
    group_members: torch.Tensor


def _check_prefixes(prefixes: DecodePrefixes, num_seqs: int, device: torch.device) -> None:
    for name, size in (("prefix_lens", num_seqs), ("group_starts", num_seqs + 1), ("group_members", num_seqs)):
        t = getattr(prefixes, name)
        if t.dtype != torch.int32 or t.shape != (size,) or t.device != device or not t.is_contiguous():
            raise ValueError(f"prefixes.{name} must be a contiguous int32 [{size}] tensor on {device}, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    num_splits: int | None = None,
    prefixes: DecodePrefixes | None = None,
    num_prefix_splits: int | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over a paged KV cache; writes and returns `out`.

    q, out: [num_seqs, num_q_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim]; block_tables: int32 [num_seqs, max_blocks_per_seq]; context_lens: int32 [num_seqs]
    (0 gives a zero output). num_splits defaults to num_decode_splits(...). With `prefixes`, each group's
    shared prefix is read once for all its members (num_prefix_splits splits, default num_splits: measured on
    an H200 at the GRPO shape, one each beat two and four, shared or not)
    and each sequence's own tokens after it apart; the merge of the splits is fixed, so results are
    bit-reproducible and the same whatever the grouping. workspace: a flat fp32 tensor of at least
    decode_workspace_shape(..., prefixes=prefixes is not None) elements; without one, a per-device buffer is
    cached, which must then exist before any CUDA-graph capture (run the shape eagerly first).
    """
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens, out)
    num_seqs, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_splits is None:
        num_splits = num_decode_splits(num_seqs, num_kv_heads, block_tables.shape[1], block_size, q.device)
    if not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {_MAX_SPLITS}], got {num_splits}")
    prefix_splits = 0
    if prefixes is not None:
        _check_prefixes(prefixes, num_seqs, q.device)
        prefix_splits = num_prefix_splits or num_splits
        if not 1 <= prefix_splits <= _MAX_SPLITS:
            raise ValueError(f"num_prefix_splits must be in [1, {_MAX_SPLITS}], got {prefix_splits}")
    total_splits = prefix_splits + num_splits
    partial_out = lse = out  # one split: phase 1 writes `out` itself and never touches these
    if total_splits > 1:
        numel = _workspace_numel(num_seqs, num_q_heads, head_dim, total_splits)
        workspace = _get_workspace(workspace, numel, q.device)
        num_partial = num_seqs * num_q_heads * total_splits * head_dim
        partial_out, lse = workspace[:num_partial], workspace[num_partial:numel]
    queries_per_kv = num_q_heads // num_kv_heads
    groups = prefixes or DecodePrefixes(context_lens, context_lens, context_lens)  # never read without prefixes
    # The Triton interpreter (CPU) keeps 16-bit floats as raw uint16 bits and tl.dot multiplies those
    # bits as integers, so off-GPU the operands are upcast to fp32 first.
    dot_dtype = _TL_DTYPES[q.dtype] if q.is_cuda else tl.float32
    _decode_split_kernel[(num_seqs, num_kv_heads, total_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        groups.prefix_lens,
        groups.group_starts,
        groups.group_members,
        out,
        partial_out,
        lse,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        NUM_Q_HEADS=num_q_heads,
        QUERIES_PER_KV=queries_per_kv,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        PREFIX_SPLITS=prefix_splits,
        BLOCK_H=max(16, triton.next_power_of_2(queries_per_kv)),
        BLOCK_M=prefix_block_m(queries_per_kv),
        DOT_DTYPE=dot_dtype,
        **_launch_config(head_dim, q.dtype),
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
    )
    if total_splits > 1:
        block_s = triton.next_power_of_2(total_splits)
        _decode_reduce_kernel[(num_seqs, num_q_heads)](
            partial_out,
            lse,
            out,
            out.stride(0),
            out.stride(1),
            NUM_Q_HEADS=num_q_heads,
            HEAD_DIM=head_dim,
            NUM_SPLITS=total_splits,
            BLOCK_S=block_s,
            num_warps=min(16, max(1, block_s * head_dim // 2048)),  # 64 partial-output values per thread
        )
    return out
