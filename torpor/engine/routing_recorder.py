"""Where a MoE model's sparse layers leave the experts they chose, and what a step hands back of them.

The buffer [rows, moe layers, top_k] (int16, or int32 past 32767 experts) is allocated once, sized by the largest
forward (max_num_batched_tokens tokens of a prefill, max_num_seqs rows of a decode batch); each sparse block
copies its [T, k] ids into its layer's column (`SparseMoeBlock.routed`), inside the decode CUDA graphs too (the
graphs write the same buffer, so replays leave their ids there). That device copy is all a step costs when no
request asked: `collect` reads the buffer back (one gather and one device-to-host copy) only for a batch holding
a request with `return_routed_experts`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from torpor.engine.models import ModelConfig
from torpor.engine.routed_experts import expert_id_dtype


class RoutingRecorder:
    def __init__(self, model: nn.Module, model_config: ModelConfig, rows: int, device: torch.device) -> None:
        blocks = model.moe_blocks
        dtype = getattr(torch, expert_id_dtype(model_config.num_experts).name)
        self.buffer = torch.zeros(rows, len(blocks), model_config.num_experts_per_tok, dtype=dtype, device=device)
        for layer, block in enumerate(blocks):
            block.routed = self.buffer[:, layer]

    @staticmethod
    def nbytes(model_config: ModelConfig, rows: int) -> int:
        """Device bytes of the buffer (0 for a dense model: it has none)."""
        itemsize = expert_id_dtype(model_config.num_experts).itemsize
        return rows * len(model_config.moe_layers) * model_config.num_experts_per_tok * itemsize

    def collect(self, seqs: list, rows: torch.Tensor | None) -> list[np.ndarray | None] | None:
        """The [layers, top_k] ids of each of `seqs` that asked for them (None for the others), read from the forward's
        rows `rows[i]` (None: row i, a decode batch); None when no sequence asked."""
        wanted = [i for i, seq in enumerate(seqs) if seq.sampling_params.return_routed_experts]
        if not wanted:
            return None
        index = torch.tensor(wanted, device=self.buffer.device)
        picked = self.buffer[index if rows is None else rows.to(self.buffer.device)[index]].cpu().numpy()
        out: list[np.ndarray | None] = [None] * len(seqs)
        for j, i in enumerate(wanted):
            out[i] = picked[j]
        return out
