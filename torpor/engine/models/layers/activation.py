"""SwiGLU activation on a fused [gate | up] projection."""

import torch
import torch.nn.functional as F
from torch import nn

from torpor.engine.models.layers import fused


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.is_cuda and fused.fused_available(gate_up):
            return fused.silu_and_mul(gate_up)  # one Triton kernel, bit-identical on CUDA
        gate, up = gate_up.chunk(2, dim=-1)  # [num_tokens, intermediate_size] each
        return F.silu(gate) * up
