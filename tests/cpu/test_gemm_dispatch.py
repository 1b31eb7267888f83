"""gemm.linear off CUDA is F.linear, bit for bit; EngineConfig.gemm is validated with a clear error."""

import pytest
import torch
import torch.nn.functional as F

from torpor.engine import gemm
from torpor.engine.config import EngineConfig


@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_linear_is_torch_linear(with_bias):
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 16), torch.randn(8, 16)
    b = torch.randn(8) if with_bias else None
    assert torch.equal(gemm.linear(x, w, b), F.linear(x, w, b))


def test_gemm_choice_is_validated():
    assert EngineConfig(model="m").gemm == "cublaslt"
    assert EngineConfig(model="m", gemm="torch").gemm == "torch"
    with pytest.raises(ValueError, match=r"gemm must be one of \('cublaslt', 'torch'\), got 'cublas'"):
        EngineConfig(model="m", gemm="cublas")
