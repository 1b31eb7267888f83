"""Checks shared by the fused-kernel tests (tests/cpu/test_fused_interpret.py in Triton's interpreter,
tests/gpu/test_fused.py compiled on CUDA). Imports torch only: the interpreter tests must set
TRITON_INTERPRET before triton's first import."""

import references
import torch

# The norms reduce their sum of squares in another order than PyTorch, so the normalized value h * rsqrt(...)
# can come out 1 ulp off after rounding; times a weight of |w| < 1 that is up to 2 ulp of the (smaller) output.
NORM_ULP = 2


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place between two 16-bit float tensors of one dtype."""
    keys = []
    for t in (a, b):
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        keys.append(torch.where(bits < 0, -(bits & 0x7FFF), bits))  # sign-magnitude -> monotonic integers
    return (keys[0] - keys[1]).abs()


def assert_matches(out: torch.Tensor, ref: torch.Tensor, *, exact: bool = False, max_ulp: int = 1) -> None:
    """exact: bit for bit. Otherwise fp32 within 1e-5 of max |ref|; 16-bit at most `max_ulp` ulp, in < 1%."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if out.numel() == 0:
        return
    if exact:
        assert torch.equal(out, ref), f"{(out != ref).sum().item()} of {out.numel()} elements differ"
    elif out.dtype == torch.float32:
        scale = ref.abs().max().clamp_min(1e-30)
        assert ((out - ref).abs().max() / scale).item() <= 1e-5
    else:
        ulps = ulp_distance(out, ref)
        assert ulps.max().item() <= max_ulp, f"{ulps.max().item()} ulp"
        assert (ulps > 0).float().mean().item() < 0.01, f"{(ulps > 0).sum().item()} of {out.numel()} differ"


def assert_heads_match(out: torch.Tensor, ref: torch.Tensor, head_dim: int) -> None:
    """Norm then rotary, 16-bit: a 1-ulp difference left by the norm is rotated into outputs that may be much
    smaller than their inputs, so the error is measured in ulps of the head's largest value: NORM_ULP, in < 1%."""
    if out.dtype == torch.float32 or out.numel() == 0:
        assert_matches(out, ref)
        return
    assert (out != ref).float().mean().item() < 0.01, f"{(out != ref).sum().item()} of {out.numel()} differ"
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10}[out.dtype]
    out, ref = (t.reshape(t.shape[0], -1, head_dim).float() for t in (out, ref))
    head_ulp = torch.exp2(torch.floor(torch.log2(ref.abs().amax(-1, keepdim=True))) - mantissa_bits)
    assert ((out - ref).abs() <= NORM_ULP * head_ulp).all(), f"{((out - ref).abs() / head_ulp).max().item()} head ulp"


def random_rows(
    num_rows: int, hidden: int, dtype: torch.dtype, seed: int, device: str = "cpu"
) -> tuple[torch.Tensor, ...]:
    """x, residual [num_rows, hidden] and a norm weight [hidden] near 1."""
    g = torch.Generator(device).manual_seed(seed)
    x, residual = (torch.randn(num_rows, hidden, generator=g, device=device).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(hidden, generator=g, device=device)).to(dtype)
    return 3 * x, residual, weight  # the residual stream is larger than one layer's output in real models


def qkv_case(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    norm: bool,
    seed: int,
    device: str = "cpu",
    max_positions: int = 4096,
) -> tuple:
    """qkv [T, (num_heads + 2 * num_kv_heads) * head_dim], cos_sin at random positions, q/k norm weights
    (None without `norm`)."""
    from torpor.engine.models.layers.rotary import RotaryEmbedding

    g = torch.Generator(device).manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=g, device=device).to(dtype)
    rotary = RotaryEmbedding(head_dim, max_positions=max_positions, theta=1e6, scaling=None).to(device)
    cos_sin = rotary(torch.randint(0, max_positions, (num_tokens,), generator=g, device=device))
    weights = [(1 + 0.1 * torch.randn(head_dim, generator=g, device=device)).to(dtype) for _ in range(2)]
    return qkv, cos_sin, *(weights if norm else [None, None])


def check_qk_norm_rope(fused, case: tuple, num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
    """qk_norm_rope_ against its reference on `case` (from qkv_case): v untouched, q/k within the norms'
    ulps (exact for rotary alone: the same fp32 products). Returns what qk_norm_rope_ returned."""
    qkv, cos_sin, q_weight, k_weight = case
    out, ref = qkv.clone(), qkv.clone()
    args = (cos_sin, num_heads, num_kv_heads, head_dim, q_weight, k_weight, eps)
    returned = fused.qk_norm_rope_(out, *args)
    references.qk_norm_rope_reference(ref, *args)
    v_start = (num_heads + num_kv_heads) * head_dim
    assert torch.equal(out[:, v_start:], qkv[:, v_start:])  # v untouched
    if q_weight is not None:
        assert_heads_match(out[:, :v_start], ref[:, :v_start], head_dim)
    else:
        assert_matches(out[:, :v_start], ref[:, :v_start], exact=True)
    return returned
