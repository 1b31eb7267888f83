"""Token embedding table, vocab-parallel: each rank holds rows [rank * n, (rank + 1) * n) of the table
(n = vocab_size / tp_size); tokens outside a rank's rows embed to zero there and the sum over ranks
is the full embedding. With one rank it is a plain lookup."""

import torch
import torch.nn.functional as F
from torch import nn

from torpor.engine.distributed import all_reduce, gather_last_dim, shard_size, tp_rank, tp_size
from torpor.engine.models.layers.loading import default_weight_loader


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.num_local = shard_size(vocab_size, "vocab_size")
        self.first = tp_rank() * self.num_local
        self.weight = nn.Parameter(torch.empty(self.num_local, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if tp_size() > 1:
            if loaded_weight.shape[0] != self.num_local * tp_size():
                raise ValueError(f"embedding: expected {self.num_local * tp_size()} rows, got "
                                 f"{tuple(loaded_weight.shape)}")
            loaded_weight = loaded_weight.narrow(0, self.first, self.num_local)
        default_weight_loader(param, loaded_weight, shard_id)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)  # [num_tokens, hidden_size]
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))


def gather_logits(local_logits: torch.Tensor) -> torch.Tensor:
    """[N, vocab_size / tp_size] logits of this rank's vocab rows -> [N, vocab_size] on every rank."""
    return gather_last_dim(local_logits)
