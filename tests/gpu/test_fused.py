"""The compiled fused layer kernels (layers/fused.py) on a CUDA device, against the model code's own ops:
bit for bit where the math is the same (silu_and_mul, rotary, the residual add), within 1 ulp in < 1% of
elements for the norms (their sum of squares is reduced in another order); CUDA-graph replay."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytestmark = pytest.mark.gpu
triton = pytest.importorskip("triton")

import references  # noqa: E402
from fused_checks import (  # noqa: E402
    NORM_ULP,
    assert_matches,
    check_qk_norm_rope,
    qkv_case,
    random_rows,
)
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from torpor.engine.models.layers import fused  # noqa: E402

if not fused._load_triton():
    pytest.skip("triton cannot be imported", allow_module_level=True)
if isinstance(fused._rms_norm_kernel, InterpretedFunction):
    pytest.skip(
        "TRITON_INTERPRET is set in this process (the CPU interpreter tests set it): "
        "run tests/gpu in its own pytest process",
        allow_module_level=True,
    )

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-6
DEVICE = "cuda"


NORM_SHAPES = [(0, 64), (1, 64), (7, 1000), (1, 4096), (256, 4096), (3, 16384)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_rows", "hidden"), NORM_SHAPES)
def test_add_rms_norm(dtype, num_rows, hidden):
    x, residual, weight = random_rows(num_rows, hidden, dtype, seed=num_rows, device=DEVICE)
    out, residual_out = fused.add_rms_norm(x, residual, weight, EPS)
    ref, ref_residual = references.add_rms_norm_reference(x, residual, weight, EPS)
    assert torch.equal(residual_out, x + residual)
    assert_matches(residual_out, ref_residual, exact=True)
    assert_matches(out, ref, max_ulp=NORM_ULP)
    ones = torch.ones_like(weight)  # out is then the normalized value itself: at most 1 ulp off
    assert_matches(
        fused.add_rms_norm(x, residual, ones, EPS)[0], references.add_rms_norm_reference(x, residual, ones, EPS)[0]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_rows", "hidden"), NORM_SHAPES)
def test_rms_norm(dtype, num_rows, hidden):
    x, _, weight = random_rows(num_rows, hidden, dtype, seed=10 + num_rows, device=DEVICE)
    assert_matches(fused.rms_norm(x, weight, EPS), references.rms_norm_reference(x, weight, EPS), max_ulp=NORM_ULP)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 256])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "norm"),
    [
        (32, 8, 128, True),  # Qwen3-8B
        (16, 8, 128, True),  # Qwen3-0.6B
        (32, 8, 128, False),  # Llama 3.1 8B
        (14, 2, 64, False),  # Qwen2.5-0.5B-like
        (6, 2, 80, True),  # head_dim whose half is not a power of two
    ],
)
def test_qk_norm_rope(dtype, num_tokens, num_heads, num_kv_heads, head_dim, norm):
    case = qkv_case(
        num_tokens, num_heads, num_kv_heads, head_dim, dtype, norm, seed=1, device=DEVICE, max_positions=32768
    )
    check_qk_norm_rope(fused, case, num_heads, num_kv_heads, head_dim, EPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_rows", "intermediate"), [(0, 64), (1, 64), (7, 1000), (1, 12288), (256, 12288)])
def test_silu_and_mul(dtype, num_rows, intermediate):
    g = torch.Generator(DEVICE).manual_seed(num_rows)
    gate_up = (4 * torch.randn(num_rows, 2 * intermediate, generator=g, device=DEVICE)).to(dtype)
    # libdevice's expf and an IEEE division: the same fp32 silu as PyTorch's kernel, so bit for bit
    assert_matches(fused.silu_and_mul(gate_up), references.silu_and_mul_reference(gate_up), exact=True)


def test_fused_available():
    assert fused.fused_available(torch.zeros(1, device=DEVICE, dtype=torch.bfloat16))
    assert not fused.fused_available(torch.zeros(1))
    assert not fused.fused_available(torch.zeros(1, device=DEVICE, dtype=torch.int32))


def test_cuda_graph_replay():
    x, residual, weight = random_rows(1, 4096, torch.bfloat16, seed=0, device=DEVICE)
    qkv, cos_sin, q_weight, k_weight = qkv_case(
        1, 32, 8, 128, torch.bfloat16, norm=True, seed=0, device=DEVICE, max_positions=32768
    )
    gate_up = torch.randn(1, 2 * 12288, device=DEVICE).bfloat16()
    qkv_in = qkv.clone()

    def step():
        qkv.copy_(qkv_in)
        fused.qk_norm_rope_(qkv, cos_sin, 32, 8, 128, q_weight, k_weight, EPS)
        return (*fused.add_rms_norm(x, residual, weight, EPS), fused.silu_and_mul(gate_up), qkv)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    for seed in (1, 2):
        new_x, new_residual, _ = random_rows(1, 4096, torch.bfloat16, seed=seed, device=DEVICE)
        x.copy_(new_x)
        residual.copy_(new_residual)
        gate_up.normal_()
        qkv_in.normal_()
        graph.replay()
        replayed = [t.clone() for t in outputs]  # the eager step below rewrites qkv in place
        for got, want in zip(replayed, step(), strict=True):
            assert torch.equal(got, want)
