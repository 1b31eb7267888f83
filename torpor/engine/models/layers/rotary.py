"""Rotary position embedding (non-interleaved halves, as in Hugging Face Llama/Qwen)."""

import math

import torch
from torch import nn

from torpor.engine.models.config import RopeScaling


def compute_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32, CPU), with Llama 3.1 scaling when given."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3.1: long wavelengths (beyond the original context / low_freq_factor) are slowed down by
    # `factor`, short ones (below original context / high_freq_factor) kept, the band between blended.
    wavelen = 2 * math.pi / inv_freq
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = (
        old_len / scaling.low_freq_factor,
        old_len / scaling.high_freq_factor,
    )
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table as a (non-persistent) buffer, so it lives with the weights. It is not in
    checkpoints: after the weights' memory was discarded, `reset_buffers` recomputes it in place."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        # [max_positions, head_dim] = [cos | sin], float32 whatever the model dtype
        table = torch.empty(max_positions, head_dim, dtype=torch.float32)
        self.register_buffer("cos_sin_cache", table, persistent=False)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """(Re)compute the table into the existing buffer. Computed on the CPU, so the values are the
        same on every device and in every recomputation."""
        inv_freq = compute_inv_freq(self.head_dim, self.theta, self.scaling)
        positions = torch.arange(self.cos_sin_cache.shape[0], dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inv_freq)
        self.cos_sin_cache.copy_(torch.cat([freqs.cos(), freqs.sin()], dim=-1))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.cos_sin_cache[positions]  # [num_tokens, head_dim]


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] by cos_sin [num_tokens, head_dim]; math in float32."""
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [num_tokens, 1, head_dim // 2] each
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
