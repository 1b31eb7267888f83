"""Qwen3-MoE's sparse MLP: the router (`gate`), top-k routing, and every expert's weights fused per layer.

Numerics as transformers' `Qwen3MoeSparseMoeBlock`: router logits in the model dtype, softmax in float32,
top-k, renormalised to sum 1 when `norm_topk_prob`, cast to the model dtype; each chosen expert computes
down(silu(gate(x)) * up(x)) in the model dtype, times its routing weight (rounded to the dtype); a token's
k contributions are added in ascending expert id, each sum rounded to the dtype (transformers' loop over
experts with `index_add_`). Both paths here do exactly that: `experts_reference` (PyTorch: CPU, and the
reference of the kernels) and, on CUDA, `fused_moe.fused_experts` (Triton).

A row's bits never depend on its batch: the routing is per row, the reference's GEMMs are row-invariant
(`gemm.row_invariant`), the kernels' tiles are fixed (fused_moe.py), and the order of the k-term sum is
the row's own (its expert ids). So prefix caching on or off gives the same tokens, as for dense models.

Tensor parallel: each rank holds every expert's slice of the intermediate dimension (gate/up rows, down
columns), as the dense MLP; the router is replicated; the k-term sums of the ranks are all-reduced.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from torpor.engine.distributed import all_reduce, shard_size, tp_rank, tp_size
from torpor.engine.gemm import linear, row_invariant
from torpor.engine.models.layers import fused, fused_moe
from torpor.engine.models.layers.activation import SiluAndMul
from torpor.engine.models.layers.linear import Linear
from torpor.engine.models.layers.loading import copy_weight

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # the checkpoint's per-expert modules
# a checkpoint's per-expert tensor: (model.layers.{l}.mlp.experts).({e}).({gate,up,down}_proj).weight
EXPERT_WEIGHT = re.compile(r"^(.+\.mlp\.experts)\.(0|[1-9]\d*)\.(gate_proj|up_proj|down_proj)\.weight$")


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (expert ids [T, k] int64, most likely first; their weights [T, k] in the logits'
    dtype), as transformers' Qwen3MoeTopKRouter."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(router_logits.dtype)


def by_expert_id(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (ids, weights) pairs sorted by ascending expert id: the order its k terms are summed in."""
    sorted_ids, order = torch.sort(ids, dim=-1)
    return sorted_ids, weights.gather(-1, order)


def experts_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
    """x [T, H], gate_up [E, 2I, H], down [E, H, I], ids/weights [T, k] sorted by ascending id per row (see
    `by_expert_id`) -> [T, H]: sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), summed in j order. One GEMM pair
    per expert over the rows that chose it (a host sync: not for CUDA graphs), row-invariant."""
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots (token * k + j) grouped by expert
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    out = x.new_empty(num_tokens * top_k, x.shape[1])
    act = SiluAndMul()
    with row_invariant():
        start = 0
        for expert, count in enumerate(counts):
            if count:
                slots = order[start:start + count]
                start += count
                out[slots] = linear(act(linear(x[slots // top_k], gate_up[expert])), down[expert])
    terms = out.view(num_tokens, top_k, -1) * weights.unsqueeze(-1)
    total = terms[:, 0]
    for j in range(1, top_k):
        total = total + terms[:, j]
    return total


class FusedExperts(nn.Module):
    """The experts of one layer as two parameters, named and laid out as transformers >= 5 holds them:
    `gate_up_proj` [E, 2I, H] ([gate | up] rows of each expert) and `down_proj` [E, H, I], I this rank's share
    of `moe_intermediate_size`. Their loaders take the checkpoint's per-expert tensors
    (`experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj` [H, I]; shard id (projection, e),
    see `LlamaForCausalLM.resolve_weight_name`) or a whole fused tensor (shard id None: a transformers >= 5
    trainer's `named_parameters()`), and write only through `copy_weight` (so they plan on meta tensors)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate = shard_size(intermediate_size, "moe_intermediate_size")  # this rank's
        i = self.intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, i), requires_grad=False)
        self.gate_up_proj.weight_loader = self._load_gate_up
        self.down_proj.weight_loader = self._load_down
        # (projection, expert) pairs the loader checks were all loaded (a whole tensor covers all of them)
        self.gate_up_proj.shard_ids = tuple((p, e) for e in range(num_experts) for p in PROJECTIONS[:2])
        self.down_proj.shard_ids = tuple(("down_proj", e) for e in range(num_experts))

    def _expert(self, shard_id: object, projections: tuple[str, ...]) -> tuple[str, int]:
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[0] in projections
                and isinstance(shard_id[1], int)):
            raise ValueError(f"unknown shard {shard_id!r} of the fused experts (expected one of {projections} "
                             "and an expert index)")
        if not 0 <= shard_id[1] < self.num_experts:
            raise ValueError(f"expert {shard_id[1]} does not exist: the layer has {self.num_experts} experts")
        return shard_id

    def _rank_part(self, loaded: torch.Tensor, dim: int, what: str) -> torch.Tensor:
        """This rank's `intermediate` slice of `loaded` along `dim` (its intermediate dimension)."""
        full = self.intermediate * tp_size()
        if loaded.dim() <= dim or loaded.shape[dim] != full:
            raise ValueError(f"{what}: expected {full} along dim {dim} (moe_intermediate_size), got shape "
                             f"{tuple(loaded.shape)}")
        return loaded if tp_size() == 1 else loaded.narrow(dim, tp_rank() * self.intermediate, self.intermediate)

    def _load_gate_up(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        i = self.intermediate
        if shard_id is None:  # [E, 2I, H], the transformers >= 5 layout
            expected = (self.num_experts, 2 * i * tp_size(), self.hidden_size)
            if tuple(loaded.shape) != expected:
                raise ValueError(f"shape mismatch: fused gate_up_proj must be {expected}, got {tuple(loaded.shape)}")
            if tp_size() == 1:
                copy_weight(param.data, loaded)
                return
            gate, up = loaded.chunk(2, dim=1)
            copy_weight(param.data[:, :i], self._rank_part(gate, 1, "gate_up_proj"))
            copy_weight(param.data[:, i:], self._rank_part(up, 1, "gate_up_proj"))
            return
        projection, expert = self._expert(shard_id, PROJECTIONS[:2])
        rows = param.data[expert, :i] if projection == "gate_proj" else param.data[expert, i:]
        copy_weight(rows, self._rank_part(loaded, 0, projection))

    def _load_down(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None:  # [E, H, I]
            if loaded.dim() != 3 or loaded.shape[0] != self.num_experts:
                raise ValueError(f"shape mismatch: fused down_proj must be [{self.num_experts}, {self.hidden_size}, "
                                 f"{self.intermediate * tp_size()}], got {tuple(loaded.shape)}")
            copy_weight(param.data, self._rank_part(loaded, 2, "down_proj"))
            return
        _, expert = self._expert(shard_id, PROJECTIONS[2:])
        copy_weight(param.data[expert], self._rank_part(loaded, 1, "down_proj"))


class SparseMoeBlock(nn.Module):
    """`mlp` of a sparse decoder layer: `gate` (the router, [E, H], replicated) and `experts`. `routed`: where
    the layer writes the expert ids it chose ([rows, k] view of the runner's routing buffer, row i = token i of
    the forward; None: not recorded). A device copy of [T, k] ids per layer, no host sync: CUDA-graph safe."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 normalize: bool) -> None:
        super().__init__()
        self.top_k, self.normalize = top_k, normalize
        self.gate = Linear(hidden_size, num_experts)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size)
        self.routed: torch.Tensor | None = None
        # The experts' path: None picks the Triton kernels wherever they run compiled (CUDA), the PyTorch
        # reference elsewhere; True / False force one (tests run the kernels in Triton's interpreter on CPU).
        self.use_kernels: bool | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = route(self.gate(x), self.top_k, self.normalize)
        if self.routed is not None:
            self.routed[: x.shape[0]].copy_(ids)
        ids, weights = by_expert_id(ids, weights)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        if fused.fused_available(x) if self.use_kernels is None else self.use_kernels:
            out = fused_moe.fused_experts(x, gate_up, down, ids, weights)
        else:
            out = experts_reference(x, gate_up, down, ids, weights)
        return out if tp_size() == 1 else all_reduce(out)
