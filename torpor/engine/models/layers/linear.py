"""Linear layers, tensor-parallel gpt-fast style: each layer owns its sharding (its weight loader slices the
full checkpoint tensor by rank) and its collective, so the model code never sees the ranks. With one rank
every shard is the whole tensor and no collective runs.

Column-parallel (Linear with shard="column", MergedLinear, QKVLinear): each rank holds a slice of the
output rows; the output stays sharded. Row-parallel (RowParallelLinear): each rank holds a slice of the
input columns; the partial outputs are summed over the ranks."""

from collections.abc import Sequence

import torch
from torch import nn

from torpor.engine.distributed import all_reduce, shard_size, tp_rank, tp_size
from torpor.engine.gemm import linear
from torpor.engine.models.layers.loading import copy_weight, default_weight_loader


def _rank_slice(loaded: torch.Tensor, dim: int, size: int, what: str) -> torch.Tensor:
    """This rank's `size` rows (dim 0) or columns (dim 1) of a full checkpoint tensor."""
    if tp_size() == 1:
        return loaded
    if loaded.dim() <= dim or loaded.shape[dim] != size * tp_size():
        raise ValueError(f"{what}: expected {size * tp_size()} along dim {dim} to split over "
                         f"{tp_size()} ranks, got shape {tuple(loaded.shape)}")
    return loaded.narrow(dim, tp_rank() * size, size)


class Linear(nn.Module):
    """y = x W^T (+ b) with W of shape [output_size, input_size]. `shard="column"`: this rank holds
    output rows [rank * n, (rank + 1) * n) of the full layer, n = output_size / tp_size."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, shard: str | None = None) -> None:
        super().__init__()
        self.shard = shard
        if shard == "column":
            output_size = shard_size(output_size, "output size of a column-parallel layer")
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        for param in self.parameters():
            param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if self.shard == "column":
            loaded_weight = _rank_slice(loaded_weight, 0, param.shape[0], "column-parallel weight")
        default_weight_loader(param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """`input_size` is the full layer's; this rank holds input columns [rank * n, (rank + 1) * n) and
    the ranks' partial outputs are summed (the bias added once, after the sum)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(shard_size(input_size, "input size of a row-parallel layer"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if param.dim() == 2:
            loaded_weight = _rank_slice(loaded_weight, 1, param.shape[1], "row-parallel weight")
        default_weight_loader(param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return linear(x, self.weight, self.bias)
        out = all_reduce(linear(x, self.weight))  # [num_tokens, output_size]
        return out if self.bias is None else out + self.bias


class MergedLinear(Linear):
    """Several column-parallel linear layers sharing one input, fused along the output: shard i owns
    (this rank's part of) output rows [sum(output_sizes[:i]), sum(output_sizes[:i + 1])). One GEMM
    instead of several (decode speed). `output_sizes` are the full layers'."""

    def __init__(
        self, input_size: int, output_sizes: Sequence[int], bias: bool = False, shard_ids: Sequence = ()
    ) -> None:
        local_sizes = [shard_size(s, "output size of a column-parallel layer") for s in output_sizes]
        super().__init__(input_size, sum(local_sizes), bias)
        self.output_sizes = local_sizes
        self.shard_ids = tuple(shard_ids) or tuple(range(len(output_sizes)))
        for param in self.parameters():
            param.shard_ids = self.shard_ids  # the loader checks every shard was loaded

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id not in self.shard_ids:
            raise ValueError(f"unknown shard {shard_id!r} of a fused layer with shards {self.shard_ids}")
        index = self.shard_ids.index(shard_id)
        offset, size = sum(self.output_sizes[:index]), self.output_sizes[index]
        loaded_weight = _rank_slice(loaded_weight, 0, size, f"shard {shard_id!r}")
        copy_weight(param.data.narrow(0, offset, size), loaded_weight)


class QKVLinear(MergedLinear):
    """The q, k and v projections fused: output = [q (num_heads * head_dim) | k | v] where k and v
    are num_kv_heads * head_dim each. Sharded by heads: `num_heads` / `num_kv_heads` are this rank's."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, shard_ids=("q", "k", "v"))
        self.num_heads = shard_size(num_heads, "num_attention_heads")
        self.num_kv_heads = shard_size(num_kv_heads, "num_key_value_heads")
