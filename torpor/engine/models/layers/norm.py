"""RMSNorm, optionally fused with the residual add that precedes it."""

import torch
from torch import nn

from torpor.engine.models.layers import fused
from torpor.engine.models.layers.loading import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32, scale in the input dtype: the same rounding points as Hugging Face.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with `residual`: (norm(x + residual), x + residual). On CUDA, rows [N, H] take one
        fused Triton kernel (same rounding points; see fused.py for the last-bit differences)."""
        if x.is_cuda and x.dim() == 2 and fused.fused_available(x):
            if residual is None:
                return fused.rms_norm(x, self.weight, self.eps)
            return fused.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
