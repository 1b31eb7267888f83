"""Linear layers. Fused layers (q/k/v, gate/up) load each checkpoint shard into their slice of rows;
tensor parallelism will later shard weights here, in the loaders, without touching the model code."""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from torpor.engine.models.layers.loading import copy_weight, default_weight_loader


class Linear(nn.Module):
    """y = x W^T (+ b) with W of shape [output_size, input_size]."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        for param in self.parameters():
            param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        default_weight_loader(param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several linear layers sharing one input, fused along the output: shard i owns output rows
    [sum(output_sizes[:i]), sum(output_sizes[:i + 1])). One GEMM instead of several (decode speed)."""

    def __init__(
        self, input_size: int, output_sizes: Sequence[int], bias: bool = False, shard_ids: Sequence = ()
    ) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.shard_ids = tuple(shard_ids) or tuple(range(len(output_sizes)))
        for param in self.parameters():
            param.shard_ids = self.shard_ids  # the loader checks every shard was loaded

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id not in self.shard_ids:
            raise ValueError(f"unknown shard {shard_id!r} of a fused layer with shards {self.shard_ids}")
        index = self.shard_ids.index(shard_id)
        offset = sum(self.output_sizes[:index])
        copy_weight(param.data.narrow(0, offset, self.output_sizes[index]), loaded_weight)


class QKVLinear(MergedLinear):
    """The q, k and v projections fused: output = [q (num_heads * head_dim) | k | v] where k and v
    are num_kv_heads * head_dim each."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, shard_ids=("q", "k", "v"))
