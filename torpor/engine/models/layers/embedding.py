"""Token embedding table."""

import torch
import torch.nn.functional as F
from torch import nn

from torpor.engine.models.layers.loading import default_weight_loader


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # [num_tokens, hidden_size]
