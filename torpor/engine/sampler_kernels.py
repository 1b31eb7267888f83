"""The sampler's inverse-CDF draw as two Triton kernels (CUDA; tests run them in Triton's interpreter).

What they compute is exactly the old draw of `Sampler._draw` (tests/references.py keeps it):

    weights = (probs * 2^36).long()                     # [rows, vocab] int64
    cdf = weights.cumsum(-1)
    target = floor(cdf[:, -1] * bits / 2^52)            # in two 26-bit halves, as torch computes it
    token = searchsorted(cdf, target, right=True).clamp(max=vocab - 1)

without the [rows, vocab] int64 tensors: the first kernel reads the float32 probabilities once and writes
each row's sums of its weights per block of BLOCK columns ([rows, blocks] int64); the second, one program
per row, adds the block sums up (the row's total, so the target), takes the first block whose running total
passes the target, and recomputes that block's weights to find the token inside it. At [512, 151936] that
is one read of the 311 MB of probabilities instead of the ~2.8 GB the quantization (in-place scaling, the
int64 copy) and the int64 cumsum moved.

Why it is the same token, bit for bit:
- the weights are the same integers: scaling by a power of two is exact, the conversion truncates toward
  zero as torch's does, and NaN (NaN logits) becomes INT64_MIN as torch's conversion does on CPU and CUDA;
- integer sums are exact in any order (modulo 2^64 too), so the block sums, their running totals and the
  cdf at any column are exactly what the cumsum holds there;
- with no negative weight the cdf does not decrease, so searchsorted's answer (the first column whose cdf
  is above the target) lies in the first block whose running total is above it, at the position where
  the block's own cumsum passes the target;
- a row with a negative weight (NaN probabilities: torch's answer is then an artifact of its binary search
  over a cdf that is not sorted) runs that binary search itself, probing the cdf at the same columns as
  torch's upper_bound does (aten/src/ATen/native/cuda/Bucketization.cu), so it returns the same column.

Importing this module does not import triton (CPU engines never need it; the interpreter tests must set
TRITON_INTERPRET before triton's first import): `_load_triton` imports it on first use and only then applies
`triton.jit` to the functions marked `@_jit` (lazy_jit.LazyJit, as layers/fused.py).
"""

from __future__ import annotations  # keeps the kernels' `tl.constexpr` annotations unevaluated until then

from typing import Any

import torch

from torpor.engine.lazy_jit import LazyJit

BLOCK = 2048  # columns per block sum: 75 blocks a row at Qwen3's vocabulary (151936)
_MAX_BLOCKS = 4096  # one program per row adds a row's block sums in registers

# Bound by _load_triton(); the kernels below look them up as module globals when they are compiled.
triton: Any = None
tl: Any = None
_kernels = LazyJit(globals())
_jit = _kernels.jit
_load_triton = _kernels.load  # import triton and jit the kernels, once; False where triton cannot be imported


def available(probs: torch.Tensor) -> bool:
    """Whether the kernels can run compiled on `probs`: a CUDA tensor, with triton importable."""
    return probs.is_cuda and _load_triton()


# ---------------------------------------------------------------------------------------------------------
# Kernels (device functions first)


@_jit
def _quantize(p):
    """torch's `(p * 2.0**36).long()` of float32 p: exact scaling, truncation toward zero, NaN -> INT64_MIN
    (the value torch's conversion gives on CPU and CUDA; converting NaN itself is undefined, so it is not)."""
    is_number = p == p
    w = (tl.where(is_number, p, 0.0) * 68719476736.0).to(tl.int64)  # 2^36: p <= 1, so w <= 2^36
    return tl.where(is_number, w, -9223372036854775808)


@_jit
def _block_sums_kernel(
    probs_ptr,
    sums_ptr,
    negative_ptr,
    probs_stride,  # row stride of probs, in elements; the columns are contiguous
    vocab_size,
    num_blocks,
    BLOCK: tl.constexpr,
):
    """One block of one row per program: the sum of its weights (int64; exact, modulo 2^64 with NaN) and
    whether any weight is negative (int8)."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    p = tl.load(probs_ptr + row * probs_stride + cols, mask=cols < vocab_size, other=0.0)
    w = _quantize(p)  # [BLOCK]; 0 past the end of the row
    tl.store(sums_ptr + row * num_blocks + block, tl.sum(w, axis=0))
    tl.store(negative_ptr + row * num_blocks + block, (tl.min(w, axis=0) < 0).to(tl.int8))


@_jit
def _cdf_at(probs_row, sums, blocks, col, BLOCK: tl.constexpr):
    """cdf[col] of a row (modulo 2^64, as torch's int64 cumsum): the block sums before col's block plus
    the weights of that block up to col. sums/blocks: [NUM_BLOCKS_POW2] block sums and block indices."""
    block = col // BLOCK
    before = tl.sum(tl.where(blocks < block, sums, 0), axis=0)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    w = _quantize(tl.load(probs_row + cols, mask=cols <= col, other=0.0))
    return before + tl.sum(w, axis=0)


@_jit
def _draw_kernel(
    probs_ptr,
    sums_ptr,
    negative_ptr,
    bits_ptr,  # [rows] float64: the random integers in [0, 2^52) (the sampler's input row 3)
    out_ptr,  # [rows] int64: the token ids
    probs_stride,
    vocab_size,
    num_blocks,
    BLOCK: tl.constexpr,
    NUM_BLOCKS_POW2: tl.constexpr,
    HALF_BITS: tl.constexpr,  # 26: the target in two halves of the 52 random bits
):
    """One row per program: searchsorted(cdf, target, right=True) clamped to the vocabulary, exactly."""
    row = tl.program_id(0).to(tl.int64)
    probs_row = probs_ptr + row * probs_stride
    blocks = tl.arange(0, NUM_BLOCKS_POW2)
    in_row = blocks < num_blocks
    sums = tl.load(sums_ptr + row * num_blocks + blocks, mask=in_row, other=0)  # [NUM_BLOCKS_POW2] int64
    ends = tl.cumsum(sums, axis=0)  # cdf at each block's last column
    total = tl.sum(sums, axis=0)
    bits = tl.load(bits_ptr + row).to(tl.int64)
    high = bits >> HALF_BITS
    low = bits & ((1 << HALF_BITS) - 1)
    target = (total * high + ((total * low) >> HALF_BITS)) >> HALF_BITS  # floor(total * bits / 2^52)

    # Non-negative weights: the cdf is sorted; the first block whose end passes the target holds the token.
    # (Past the last block, `ends` is the total, so the count stops at num_blocks; a target >= total gives
    # a column >= vocab_size, which the clamp turns into torch's answer, vocab_size - 1.)
    block = tl.sum(((ends <= target) & in_row).to(tl.int32), axis=0)
    before = tl.sum(tl.where(blocks == block, ends - sums, 0), axis=0)  # cdf before the block
    cols = block * BLOCK + tl.arange(0, BLOCK)
    w = _quantize(tl.load(probs_row + cols, mask=cols < vocab_size, other=0.0))
    cdf = before + tl.cumsum(w, axis=0)  # [BLOCK]; the block's end past the row's last column
    token = block.to(tl.int64) * BLOCK + tl.sum((cdf <= target).to(tl.int64), axis=0)

    # A negative weight (NaN): torch's binary search over the unsorted cdf, probe by probe (no iteration
    # without one; hi = lo = 0 skips the loop).
    negative = tl.max(tl.load(negative_ptr + row * num_blocks + blocks, mask=in_row, other=0), axis=0) > 0
    lo = row * 0
    hi = tl.where(negative, lo + vocab_size, lo)
    while lo < hi:
        mid = lo + ((hi - lo) >> 1)
        above = _cdf_at(probs_row, sums, blocks, mid, BLOCK) > target
        hi = tl.where(above, mid, hi)
        lo = tl.where(above, lo, mid + 1)
    token = tl.where(negative, lo, token)
    tl.store(out_ptr + row, tl.minimum(token, vocab_size - 1))


# ---------------------------------------------------------------------------------------------------------
# Launchers


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def block_sums(probs: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [rows, vocab] float32 -> (per-block weight sums [rows, blocks] int64, whether a block holds a
    negative weight [rows, blocks] int8), blocks = ceil(vocab / block)."""
    _check(probs, block)
    rows, vocab_size = probs.shape
    num_blocks = -(-vocab_size // block)
    sums = torch.empty(rows, num_blocks, dtype=torch.int64, device=probs.device)
    negative = torch.empty(rows, num_blocks, dtype=torch.int8, device=probs.device)
    if rows:
        _block_sums_kernel[(rows, num_blocks)](
            probs, sums, negative, probs.stride(0), vocab_size, num_blocks, BLOCK=block, num_warps=4,
            enable_fp_fusion=False,  # nothing to fuse (a product is never added to); newer triton asks
        )
    return sums, negative


def inverse_cdf(probs: torch.Tensor, bits: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The token of each row drawn by the random integer `bits` [rows] (float64, in [0, 2^52)) from the
    probabilities `probs` [rows, vocab] float32 (columns contiguous): [rows] int64, exactly the old
    full-cumsum draw's. Two launches, no host synchronization."""
    if bits.shape != probs.shape[:1] or bits.dtype != torch.float64 or bits.device != probs.device:
        raise ValueError(f"bits must be float64 [{probs.shape[0]}] on {probs.device}, got {bits.dtype} {bits.shape}")
    sums, negative = block_sums(probs, block)
    rows, vocab_size = probs.shape
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    if rows:
        _draw_kernel[(rows,)](
            probs, sums, negative, bits.contiguous(), out, probs.stride(0), vocab_size, sums.shape[1],
            BLOCK=block, NUM_BLOCKS_POW2=_next_power_of_2(sums.shape[1]), HALF_BITS=26, num_warps=4,
            enable_fp_fusion=False,
        )
    return out


def _check(probs: torch.Tensor, block: int) -> None:
    if not _load_triton():
        raise RuntimeError("the sampler kernels need triton, which cannot be imported here")
    if probs.dim() != 2 or probs.dtype != torch.float32 or not 0 < probs.shape[1] < 2**31:
        raise ValueError(f"probs must be float32 [rows, 0 < vocab < 2^31], got {probs.dtype} {tuple(probs.shape)}")
    if probs.shape[0] and probs.stride(1) != 1:
        raise ValueError(f"probs must be contiguous in its last dimension, got strides {probs.stride()}")
    if block < 16 or block & (block - 1) or -(-probs.shape[1] // block) > _MAX_BLOCKS:
        raise ValueError(f"block must be a power of two >= 16 leaving <= {_MAX_BLOCKS} blocks a row, got {block}")
