"""Fused Triton kernels for the small per-layer ops of decode (their PyTorch references: tests/references.py).

- `add_rms_norm` / `rms_norm`: RMSNorm, with or without the residual add before it (RMSNorm.forward).
- `qk_norm_rope_`: Qwen3's per-head q/k RMSNorm (optional) then the rotary embedding, in place on the
  qkv projection's output (LlamaAttention.forward between qkv_proj and attention).
- `silu_and_mul`: SwiGLU on the fused [gate | up] projection (SiluAndMul).

Each kernel rounds at the same points as the model code and does the same fp32 math in between; the model runs
its own PyTorch ops wherever `fused_available` is False (CPU tensors, no triton). On CUDA, silu_and_mul, the
rotary and the residual add match PyTorch bit for bit (checked on an H200 with triton 3.6). The norms do not
quite: their sum of squares is reduced in another order than PyTorch's reduction kernel, so rsqrt's input can
differ in its last fp32 bit; then a few normalized values differ by 1 ulp of the dtype, up to 2 ulp after a
weight of |w| < 1 (about 4e-5 of fp16 outputs, fewer in bf16; fp32 outputs within 2e-7). What the exact parts take:
- fp contraction off (`enable_fp_fusion=False`): PyTorch rounds every product to fp32 in its own kernel,
  so `x1 * cos - x2 * sin` must not become an FMA;
- libdevice's exp, the expf that PyTorch's silu calls (tl.exp's ex2.approx differs in the last bit), and
  IEEE division (div_rn; Triton's fp32 `/` is approximate); rsqrt is libdevice's too, as torch.rsqrt's;
- round-to-nearest-even casts to the tensor's dtype after every op that PyTorch runs in that dtype.
Off CUDA (Triton's interpreter, for tests) libdevice is missing: tl.exp and tl.rsqrt (numpy's) stand in.

Importing this module does not import triton (every model imports it; CPU engines never need triton, and
the interpreter tests must set TRITON_INTERPRET before triton's first import): `_load_triton` imports it on
first use and only then applies `triton.jit` to the functions marked `@_jit`.
"""

from __future__ import annotations  # keeps the kernels' `tl.constexpr` annotations unevaluated until then

import functools
import importlib
from typing import Any

import torch

from torpor.engine.lazy_jit import LazyJit
from torpor.engine.models.config import DTYPES

_SUPPORTED_DTYPES = tuple(DTYPES.values())
_MAX_HIDDEN = 16384  # one row per program, held in registers

# Bound by _load_triton(); the kernels below look them up as module globals when they are compiled.
triton: Any = None
tl: Any = None
libdevice: Any = None  # triton.language.extra's libdevice (exp, rsqrt), or None where it cannot be imported
_kernels = LazyJit(globals())
_jit = _kernels.jit


@functools.cache
def _load_triton() -> bool:
    """Import triton and jit the kernels, once (lazy_jit.LazyJit), and find libdevice; False where triton cannot
    be imported."""
    global libdevice
    if not _kernels.load():
        return False
    # The generic module (3.6, 3.9) dispatches to the backend's libdevice; the CUDA one is the older path.
    for name in ("triton.language.extra.libdevice", "triton.language.extra.cuda.libdevice"):
        try:
            libdevice = importlib.import_module(name)
            break
        except ImportError:
            continue
    return True


def fused_available(tensor: torch.Tensor) -> bool:
    """Whether the fused kernels can run compiled on `tensor`: a CUDA tensor of a supported dtype, with triton."""
    return tensor.is_cuda and tensor.dtype in _SUPPORTED_DTYPES and _load_triton()


# ---------------------------------------------------------------------------------------------------------
# Kernels (device functions first)


@_jit
def _to_dtype(x, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 x rounded to nearest even in DTYPE. SOFT_BF16 (DTYPE is bf16): with integer ops, for Triton's
    interpreter, whose fp32 -> bf16 cast truncates."""
    if SOFT_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(DTYPE)
    return y


@_jit
def _rsqrt(x, ACCURATE: tl.constexpr):
    return libdevice.rsqrt(x) if ACCURATE else tl.rsqrt(x)  # libdevice's is rsqrtf, as torch.rsqrt on CUDA


@_jit
def _exp(x, ACCURATE: tl.constexpr):
    return libdevice.exp(x) if ACCURATE else tl.exp(x)  # libdevice's is expf, as F.silu on CUDA


@_jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    x_stride,  # row strides, in elements; the last dimension is contiguous
    residual_stride,
    out_stride,
    residual_out_stride,
    eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= H
    HAS_RESIDUAL: tl.constexpr,
    ACCURATE: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    """One row per program: out = weight * norm(s), s = x (+ residual, also stored to residual_out)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    h = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0).to(tl.float32)
        s = _to_dtype(h + r, out_ptr.dtype.element_ty, SOFT_BF16)  # x + residual in the input dtype
        tl.store(residual_out_ptr + row * residual_out_stride + cols, s, mask=mask)
        h = s.to(tl.float32)
    # mean(h^2) as PyTorch's CUDA mean: the sum times fp32(1 / H)
    rstd = _rsqrt(tl.sum(h * h, axis=0) * (1.0 / H) + eps, ACCURATE)
    n = _to_dtype(h * rstd, out_ptr.dtype.element_ty, SOFT_BF16).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, _to_dtype(w * n, out_ptr.dtype.element_ty, SOFT_BF16), mask=mask)


@_jit
def _scale_rounded(h, is_q, q_weight_ptr, k_weight_ptr, dims, dim_ok, SOFT_BF16: tl.constexpr):
    """weight * h, each rounded to the weights' dtype (RMSNorm's last step): h [BLOCK_HEADS, BLOCK_HALF] fp32."""
    dtype = q_weight_ptr.dtype.element_ty
    n = _to_dtype(h, dtype, SOFT_BF16).to(tl.float32)
    q_w = tl.load(q_weight_ptr + dims, mask=dim_ok, other=0.0)[None, :]
    k_w = tl.load(k_weight_ptr + dims, mask=dim_ok, other=0.0)[None, :]
    w = tl.where(is_q, q_w, k_w).to(tl.float32)
    return _to_dtype(w * n, dtype, SOFT_BF16).to(tl.float32)


@_jit
def _qk_norm_rope_kernel(
    qkv_ptr,
    cos_sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    qkv_stride,  # row strides, in elements
    cos_sin_stride,
    eps,
    NUM_HEADS: tl.constexpr,  # q heads; k heads follow them in a row of qkv
    NUM_ROTATED: tl.constexpr,  # q + k heads
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # next power of two >= HEAD_DIM // 2
    HAS_NORM: tl.constexpr,
    ACCURATE: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    """BLOCK_HEADS q/k heads of one token per program: RMSNorm of each head (HAS_NORM), then rotary, in place."""
    HALF: tl.constexpr = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_HALF)
    dim_ok = dims < HALF
    mask = (heads < NUM_ROTATED)[:, None] & dim_ok[None, :]
    first = qkv_ptr + token * qkv_stride + heads[:, None] * HEAD_DIM + dims[None, :]  # [BLOCK_HEADS, BLOCK_HALF]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        sum_sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        rstd = _rsqrt(sum_sq * (1.0 / HEAD_DIM) + eps, ACCURATE)[:, None]
        is_q = (heads < NUM_HEADS)[:, None]
        x1 = _scale_rounded(x1 * rstd, is_q, q_weight_ptr, k_weight_ptr, dims, dim_ok, SOFT_BF16)
        x2 = _scale_rounded(x2 * rstd, is_q, q_weight_ptr + HALF, k_weight_ptr + HALF, dims, dim_ok, SOFT_BF16)
    cos_sin = cos_sin_ptr + token * cos_sin_stride + dims
    cos = tl.load(cos_sin, mask=dim_ok, other=0.0)[None, :]
    sin = tl.load(cos_sin + HALF, mask=dim_ok, other=0.0)[None, :]
    dtype = qkv_ptr.dtype.element_ty
    tl.store(first, _to_dtype(x1 * cos - x2 * sin, dtype, SOFT_BF16), mask=mask)
    tl.store(first + HALF, _to_dtype(x2 * cos + x1 * sin, dtype, SOFT_BF16), mask=mask)


@_jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    gate_up_stride,  # row strides, in elements
    out_stride,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
    ACCURATE: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    """BLOCK columns of one row per program: out = silu(gate) * up, with silu(gate) rounded to the dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    gate_ptrs = gate_up_ptr + row * gate_up_stride + cols
    g = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_ptrs + INTERMEDIATE, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    s = _to_dtype(tl.math.div_rn(g, 1.0 + _exp(-g, ACCURATE)), dtype, SOFT_BF16).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, _to_dtype(s * u, dtype, SOFT_BF16), mask=mask)


# ---------------------------------------------------------------------------------------------------------
# Launchers


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _launch_options(t: torch.Tensor) -> dict[str, Any]:
    """Flags shared by every kernel. CPU tensors run in Triton's interpreter, which has no libdevice."""
    if not _load_triton():
        raise RuntimeError("the fused kernels need triton, which cannot be imported here")
    return {
        "ACCURATE": t.is_cuda and libdevice is not None,
        "SOFT_BF16": not t.is_cuda and t.dtype == torch.bfloat16,
        "enable_fp_fusion": False,
    }


def _check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def _check_norm_inputs(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in _SUPPORTED_DTYPES or not 0 < x.shape[1] <= _MAX_HIDDEN:
        raise ValueError(f"x must be [N, H <= {_MAX_HIDDEN}] of {_SUPPORTED_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    _check_last_dim_contiguous("x", x)
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(
                f"residual must match x, got {residual.dtype} {tuple(residual.shape)} on {residual.device}"
            )
        _check_last_dim_contiguous("residual", residual)
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [H] tensor of x's dtype, got {weight.dtype} {weight.shape}")


def _rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """norm(x [+ residual]) [N, H] and, with a residual, x + residual [N, H] (else None)."""
    _check_norm_inputs(x, residual, weight)
    num_rows, hidden = x.shape
    out = torch.empty((num_rows, hidden), dtype=x.dtype, device=x.device)
    residual_out = None if residual is None else torch.empty_like(out)
    if num_rows == 0:
        return out, residual_out
    options, block = _launch_options(x), _next_power_of_2(hidden)
    residual_src = x if residual is None else residual  # never read without a residual
    residual_dst = out if residual_out is None else residual_out  # never written without one
    _rms_norm_kernel[(num_rows,)](
        x,
        residual_src,
        weight,
        out,
        residual_dst,
        x.stride(0),
        residual_src.stride(0),
        out.stride(0),
        residual_dst.stride(0),
        eps,
        H=hidden,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 256)),  # 8 elements a thread up to H = 4096 (16 warps were fastest)
        **options,
    )
    return out, residual_out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), as RMSNorm.forward(x, residual), in one kernel.

    x, residual: [N, H] (H <= 16384, last dimension contiguous), weight: [H], all of one dtype.
    """
    out, residual_out = _rms_norm(x, residual, weight, eps)
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """norm(x), as RMSNorm.forward(x), in one kernel. x: [N, H] (H <= 16384), weight: [H] of x's dtype."""
    return _rms_norm(x, None, weight, eps)[0]


def _check_qkv(
    qkv: torch.Tensor,
    cos_sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
) -> None:
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.dtype not in _SUPPORTED_DTYPES or head_dim % 2:
        raise ValueError(
            f"qkv must be [T, {width}] of {_SUPPORTED_DTYPES} with an even head_dim, got {qkv.dtype} {tuple(qkv.shape)}"
        )
    if cos_sin.shape != (qkv.shape[0], head_dim) or cos_sin.dtype != torch.float32 or cos_sin.device != qkv.device:
        raise ValueError(f"cos_sin must be float32 [{qkv.shape[0]}, {head_dim}], got {cos_sin.dtype} {cos_sin.shape}")
    _check_last_dim_contiguous("qkv", qkv)
    _check_last_dim_contiguous("cos_sin", cos_sin)
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight go together: both (Qwen3) or neither (Llama, Qwen2)")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (w.shape != (head_dim,) or w.dtype != qkv.dtype or not w.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous [{head_dim}] tensor of qkv's dtype, got {w.dtype} {w.shape}")


def qk_norm_rope_(
    qkv: torch.Tensor,
    cos_sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> None:
    """In place on qkv [T, (num_heads + 2 * num_kv_heads) * head_dim]: RMSNorm of each q and k head when
    q_weight/k_weight [head_dim] are given, then rotary by cos_sin [T, head_dim] (float32, [cos | sin]).
    v is left untouched. The same numerics as LlamaAttention.forward's q_norm/k_norm and apply_rotary."""
    _check_qkv(qkv, cos_sin, num_heads, num_kv_heads, head_dim, q_weight, k_weight)
    num_tokens, num_rotated = qkv.shape[0], num_heads + num_kv_heads
    if num_tokens == 0:
        return
    options, block_half = _launch_options(qkv), _next_power_of_2(head_dim // 2)
    # 8 heads of 128 a program: the fastest on an H200 at T = 1 and 256 (Qwen3-8B, 4 warps)
    block_heads = min(_next_power_of_2(num_rotated), max(1, 512 // block_half))
    has_norm = q_weight is not None
    _qk_norm_rope_kernel[(num_tokens, -(-num_rotated // block_heads))](
        qkv,
        cos_sin,
        q_weight if has_norm else qkv,  # never read without the norm
        k_weight if has_norm else qkv,
        qkv.stride(0),
        cos_sin.stride(0),
        eps,
        NUM_HEADS=num_heads,
        NUM_ROTATED=num_rotated,
        HEAD_DIM=head_dim,
        BLOCK_HEADS=block_heads,
        BLOCK_HALF=block_half,
        HAS_NORM=has_norm,
        num_warps=4,
        **options,
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2 * I] = [gate | up] -> silu(gate) * up [N, I], as SiluAndMul, in one kernel."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"gate_up must be [N, 2 * I] of {_SUPPORTED_DTYPES}, got {gate_up.dtype} {gate_up.shape}")
    _check_last_dim_contiguous("gate_up", gate_up)
    num_rows, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_rows, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    # More, smaller programs for few rows (decode): on an H200, 512 was fastest at N = 1, 1024 at N = 256.
    options = _launch_options(gate_up)
    block = min(512 if num_rows < 16 else 1024, _next_power_of_2(intermediate))
    _silu_and_mul_kernel[(num_rows, -(-intermediate // block))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        INTERMEDIATE=intermediate,
        BLOCK=block,
        num_warps=4,
        **options,
    )
    return out
