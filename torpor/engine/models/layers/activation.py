"""SwiGLU activation on a fused [gate | up] projection."""

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # [num_tokens, intermediate_size] each
        return F.silu(gate) * up
