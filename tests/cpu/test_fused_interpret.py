"""The fused layer kernels (layers/fused.py), run on CPU tensors by Triton's interpreter, against the model
code's own ops (their references). On CPU the references use PyTorch's CPU kernels (Sleef's expf, a
vectorized sum) and the interpreter numpy's, so where a last fp32 bit differs a 16-bit result may be 1 ulp
off; tests/gpu/test_fused.py asserts the exact matches on CUDA."""

import os
import subprocess
import sys

import pytest
import torch

if torch.cuda.is_available():
    # Interpreter mode is process-wide and would turn the compiled kernels of tests/gpu into interpreted ones.
    pytest.skip("the interpreter tests run on machines without CUDA; tests/gpu covers it", allow_module_level=True)
# Triton's interpreter runs kernels on CPU tensors; the variable is read when triton is first imported.
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

if not isinstance(triton.language.cdiv, InterpretedFunction):
    pytest.skip(
        "triton was imported before TRITON_INTERPRET=1 could be set: run this file in its own pytest process",
        allow_module_level=True,
    )

import references  # noqa: E402
from fused_checks import (  # noqa: E402
    NORM_ULP,
    assert_matches,
    check_qk_norm_rope,
    qkv_case,
    random_rows,
)

from torpor.engine.models.layers import fused  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_rows", "hidden"), [(0, 64), (1, 64), (7, 1000), (2, 4096)])
def test_add_rms_norm(dtype, num_rows, hidden):
    x, residual, weight = random_rows(num_rows, hidden, dtype, seed=num_rows)
    x_in, residual_in = x.clone(), residual.clone()
    out, residual_out = fused.add_rms_norm(x, residual, weight, EPS)
    ref, ref_residual = references.add_rms_norm_reference(x, residual, weight, EPS)
    assert torch.equal(residual_out, x + residual)  # one rounding of the fp32 sum, as PyTorch's add
    assert_matches(residual_out, ref_residual, exact=True)
    assert_matches(out, ref, max_ulp=NORM_ULP)
    ones = torch.ones_like(weight)  # out is then the normalized value itself: at most 1 ulp off
    assert_matches(
        fused.add_rms_norm(x, residual, ones, EPS)[0], references.add_rms_norm_reference(x, residual, ones, EPS)[0]
    )
    assert torch.equal(x, x_in) and torch.equal(residual, residual_in)  # inputs are left alone


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_rows", "hidden"), [(0, 64), (1, 64), (7, 1000)])
def test_rms_norm(dtype, num_rows, hidden):
    x, _, weight = random_rows(num_rows, hidden, dtype, seed=10 + num_rows)
    assert_matches(fused.rms_norm(x, weight, EPS), references.rms_norm_reference(x, weight, EPS), max_ulp=NORM_ULP)


def test_norm_of_strided_rows():
    x, residual, weight = random_rows(5, 96, torch.bfloat16, seed=3)
    wide = torch.zeros(5, 256, dtype=torch.bfloat16)
    wide[:, 7:103] = x
    x_view = wide[:, 7:103]  # rows 256 elements apart
    out, residual_out = fused.add_rms_norm(x_view, residual, weight, EPS)
    ref, ref_residual = references.add_rms_norm_reference(x, residual, weight, EPS)
    assert_matches(out, ref, max_ulp=NORM_ULP)
    assert torch.equal(residual_out, ref_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 7])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "norm"),
    [
        (32, 8, 128, True),  # Qwen3-8B: q/k norm
        (32, 8, 128, False),  # Llama 3.1 8B: rotary only
        (14, 2, 64, False),  # Qwen2.5-0.5B-like, q + k heads not a power of two
        (6, 2, 80, True),  # head_dim whose half is not a power of two
    ],
)
def test_qk_norm_rope(dtype, num_tokens, num_heads, num_kv_heads, head_dim, norm):
    case = qkv_case(num_tokens, num_heads, num_kv_heads, head_dim, dtype, norm, seed=1)
    assert check_qk_norm_rope(fused, case, num_heads, num_kv_heads, head_dim, EPS) is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_rows", "intermediate"), [(0, 64), (1, 64), (7, 1000)])
def test_silu_and_mul(dtype, num_rows, intermediate):
    g = torch.Generator().manual_seed(num_rows)
    gate_up = (4 * torch.randn(num_rows, 2 * intermediate, generator=g)).to(dtype)
    out, ref = fused.silu_and_mul(gate_up), references.silu_and_mul_reference(gate_up)
    # numpy's expf and PyTorch CPU's (Sleef) can differ in the last fp32 bit: at most 1 ulp after rounding here
    assert_matches(out, ref)


def test_rejects_bad_inputs():
    x, residual, weight = random_rows(2, 64, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="residual must match x"):
        fused.add_rms_norm(x, residual.float(), weight, EPS)
    with pytest.raises(ValueError, match="weight must be"):
        fused.rms_norm(x, weight.float(), EPS)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        fused.rms_norm(x.t().contiguous().t(), weight, EPS)
    qkv, cos_sin, q_weight, _ = qkv_case(2, 4, 2, 64, torch.bfloat16, norm=True, seed=0)
    with pytest.raises(ValueError, match="go together"):
        fused.qk_norm_rope_(qkv, cos_sin, 4, 2, 64, q_weight, None, EPS)
    with pytest.raises(ValueError, match=r"qkv must be \[T, 1024\]"):
        fused.qk_norm_rope_(qkv, cos_sin, 4, 2, 64 * 2, None, None, EPS)
    with pytest.raises(ValueError, match="gate_up must be"):
        fused.silu_and_mul(x[:, :63])


def test_not_available_on_cpu_tensors():
    assert not fused.fused_available(torch.zeros(1))


def test_import_does_not_import_triton():
    # Every model imports fused; triton is imported only when a kernel is first used.
    code = "import sys, torpor.engine.models.layers.fused; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
