"""gemm.linear off CUDA is F.linear, bit for bit; TORPOR_GEMM is validated with a clear error."""

import pytest
import torch
import torch.nn.functional as F

from torpor.engine import gemm
from torpor.env import Env


@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_linear_is_torch_linear(with_bias):
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 16), torch.randn(8, 16)
    b = torch.randn(8) if with_bias else None
    assert torch.equal(gemm.linear(x, w, b), F.linear(x, w, b))


def test_gemm_switch_is_validated(monkeypatch):
    monkeypatch.setenv("TORPOR_GEMM", "torch")
    assert Env.read().gemm == "torch"
    monkeypatch.delenv("TORPOR_GEMM")
    assert Env.read().gemm == "cublaslt"
    monkeypatch.setenv("TORPOR_GEMM", "cublas")
    with pytest.raises(ValueError, match="TORPOR_GEMM must be one of cublaslt, torch, got 'cublas'"):
        Env.read()
