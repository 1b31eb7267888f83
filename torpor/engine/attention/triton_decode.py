"""Paged-attention decode in Triton: one query token per sequence, split-K ("flash decoding").

Phase 1 runs one program per (sequence, kv head, split). It reads its slice of the sequence's
context once, for all q heads of that kv head together (grouped-query attention), and writes a
partial output and the log-sum-exp of its scores to a workspace. Phase 2 merges the splits of
each (sequence, q head) in a fixed order, so results are bit-reproducible (no atomics).

The grid and workspace size depend only on static quantities (num_seqs, heads, max_blocks_per_seq,
SM count); the split of each sequence's actual context is computed inside the kernel. Nothing
synchronizes with the host, so the whole call can be captured in a CUDA graph.
"""

import functools
import math

import torch
import triton
import triton.language as tl

_PROGRAMS_PER_SM = 2  # phase-1 programs wanted per SM: enough loads in flight to saturate HBM
_MAX_SPLITS = 128
_MIN_SPLIT_TOKENS = 64  # no more splits than max context / this: tiny splits cost more than they save
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_SUPPORTED_DTYPES = tuple(_TL_DTYPES)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
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
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    # Each split takes an equal, BLOCK_N-aligned share of this sequence's context; late splits may be empty.
    split_len = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    head_mask = offs_h < QUERIES_PER_KV  # BLOCK_H pads the group up to a tl.dot-friendly size
    q_heads = kv_head * QUERIES_PER_KV + offs_h
    q = tl.load(
        q_ptr + seq * q_stride_seq + q_heads[:, None] * q_stride_head + offs_d[None, :],
        mask=head_mask[:, None],
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_H, HEAD_DIM]

    row_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    block_table = block_tables_ptr + seq * bt_stride_seq
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
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_H, BLOCK_N]
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        # Online softmax; every chunk has at least one valid token, so new_max is finite.
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        probs = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=token_mask[:, None], other=0.0).to(DOT_DTYPE)
        acc = acc * rescale[:, None] + tl.dot(probs.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        row_max = new_max

    normalized = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]  # empty split: zeros, not NaN
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + seq * out_stride_seq + q_heads[:, None] * out_stride_head + offs_d[None, :],
            normalized.to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None],
        )
    else:
        rows = (seq * NUM_Q_HEADS + q_heads) * NUM_SPLITS + split  # [BLOCK_H] rows of the workspace
        tl.store(partial_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], normalized, mask=head_mask[:, None])
        # A non-empty split has row_sum >= 1; an empty one has row_max = -inf, hence lse = -inf.
        tl.store(lse_ptr + rows, row_max + tl.log2(tl.maximum(row_sum, 1.0)), mask=head_mask)


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
) -> tuple[int]:
    """Shape of a flat fp32 workspace serving every batch size from 1 to max_num_seqs."""
    return (
        max(
            _workspace_numel(
                n,
                num_q_heads,
                head_dim,
                num_decode_splits(n, num_kv_heads, max_blocks_per_seq, block_size, device),
            )
            for n in range(1, max_num_seqs + 1)
        ),
    )


def alloc_decode_workspace(
    max_num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_blocks_per_seq: int,
    block_size: int,
    device: torch.device,
) -> torch.Tensor:
    """Allocate the decode workspace (call inside the model runner's workspace memory scope)."""
    shape = decode_workspace_shape(
        max_num_seqs, num_q_heads, num_kv_heads, head_dim, max_blocks_per_seq, block_size, device
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
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over a paged KV cache; writes and returns `out`.

    q, out: [num_seqs, num_q_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim]; block_tables: int32 [num_seqs, max_blocks_per_seq]; context_lens: int32 [num_seqs]
    (0 gives a zero output). num_splits defaults to num_decode_splits(...). workspace: a flat fp32
    tensor of at least decode_workspace_shape(...) elements; without one, a per-device buffer is
    cached, which must then exist before any CUDA-graph capture (run the shape eagerly first).
    """
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens, out)
    num_seqs, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_splits is None:
        num_splits = num_decode_splits(num_seqs, num_kv_heads, block_tables.shape[1], block_size, q.device)
    if not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {_MAX_SPLITS}], got {num_splits}")
    partial_out = lse = out  # one split: phase 1 writes `out` itself and never touches these
    if num_splits > 1:
        numel = _workspace_numel(num_seqs, num_q_heads, head_dim, num_splits)
        workspace = _get_workspace(workspace, numel, q.device)
        num_partial = num_seqs * num_q_heads * num_splits * head_dim
        partial_out, lse = workspace[:num_partial], workspace[num_partial:numel]
    queries_per_kv = num_q_heads // num_kv_heads
    # The Triton interpreter (CPU) keeps 16-bit floats as raw uint16 bits and tl.dot multiplies those
    # bits as integers, so off-GPU the operands are upcast to fp32 first.
    dot_dtype = _TL_DTYPES[q.dtype] if q.is_cuda else tl.float32
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
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
        BLOCK_H=max(16, triton.next_power_of_2(queries_per_kv)),
        DOT_DTYPE=dot_dtype,
        **_launch_config(head_dim, q.dtype),
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
    )
    if num_splits > 1:
        block_s = triton.next_power_of_2(num_splits)
        _decode_reduce_kernel[(num_seqs, num_q_heads)](
            partial_out,
            lse,
            out,
            out.stride(0),
            out.stride(1),
            NUM_Q_HEADS=num_q_heads,
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            BLOCK_S=block_s,
            num_warps=min(16, max(1, block_s * head_dim // 2048)),  # 64 partial-output values per thread
        )
    return out
