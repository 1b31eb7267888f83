"""The model inputs of one step: a packed prefill batch (fresh tensors), or the persistent decode buffers
that CUDA graphs read at fixed addresses."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from torpor.engine.attention.metadata import AttentionMetadata
from torpor.engine.sequence import Sequence


@dataclass
class PrefillBatch:
    input_ids: torch.Tensor      # [num_tokens] int64: every uncached token of every sequence, packed
    positions: torch.Tensor      # [num_tokens] int64
    metadata: AttentionMetadata
    starts: list[int]            # packed index of each sequence's first new token
    last_indices: torch.Tensor   # [num_seqs] int64: packed index of each sequence's last token


def new_token_slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of the tokens at positions [start, end) of a sequence."""
    slots: list[int] = []
    for j in range(start // block_size, -(-end // block_size)):
        base = block_table[j] * block_size
        slots += range(base + max(start - j * block_size, 0), base + min(end - j * block_size, block_size))
    return slots


def prepare_prefill(seqs: list[Sequence], block_size: int, device: torch.device) -> PrefillBatch:
    """Pack the uncached tokens of `seqs` (whole prompts, or prompt + outputs after a preemption)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu_seqlens = [0]
    for seq in seqs:
        start, end = seq.num_cached_tokens, len(seq)
        input_ids += seq.token_ids[start:]
        positions += range(start, end)
        slots += new_token_slots(seq.block_table, start, end, block_size)
        cu_seqlens.append(cu_seqlens[-1] + end - start)
    width = max(len(seq.block_table) for seq in seqs)
    tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs]
    context_lens = [len(seq) for seq in seqs]
    # Two host->device copies: the int64 and the int32 inputs, each packed in one tensor.
    num_tokens, num_seqs = len(input_ids), len(seqs)
    longs = torch.tensor(input_ids + positions + slots + [i - 1 for i in cu_seqlens[1:]], dtype=torch.int64)
    cu_contexts = [0, *itertools.accumulate(context_lens)]
    ints = torch.tensor(cu_seqlens + cu_contexts + context_lens + [b for row in tables for b in row], dtype=torch.int32)
    longs, ints = longs.to(device, non_blocking=True), ints.to(device, non_blocking=True)
    input_ids_t, positions_t, slots_t, last = longs.split([num_tokens, num_tokens, num_tokens, num_seqs])
    cu_t, cu_k_t, lens_t, tables_t = ints.split([num_seqs + 1, num_seqs + 1, num_seqs, num_seqs * width])
    metadata = AttentionMetadata(
        is_prefill=True,
        slot_mapping=slots_t,
        context_lens=lens_t,
        block_tables=tables_t.view(num_seqs, width),
        cu_seqlens_q=cu_t,
        max_seqlen_q=max(cu_seqlens[i + 1] - cu_seqlens[i] for i in range(num_seqs)),
        max_context_len=max(context_lens),
        cu_seqlens_k=cu_k_t,
    )
    return PrefillBatch(input_ids_t, positions_t, metadata, cu_seqlens[:-1], last)


class DecodeBuffers:
    """Inputs of decode steps at fixed addresses (allocate in the runtime memory scope): a step copies
    its batch in, padded to `batch_size` rows; padded rows write their K/V to a scratch slot and attend
    to nothing (context length 0). `hidden` receives the model's output (a CUDA graph's output buffer)."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, block_size: int, scratch_block: int) -> None:
        self.max_num_seqs, self.block_size, self.scratch_block = max_num_seqs, block_size, scratch_block
        # Rows: input ids, positions, slot mapping. int32: context lengths, then block tables.
        self.tokens = torch.zeros(3, max_num_seqs, dtype=torch.int64, device=device)
        self.tokens[2].fill_(scratch_block * block_size)
        self.lens_tables = torch.zeros(max_num_seqs * (1 + max_blocks_per_seq), dtype=torch.int32, device=device)
        self.hidden = torch.zeros(max_num_seqs, hidden_size, dtype=dtype, device=device)
        self.block_tables = self.lens_tables[max_num_seqs:].view(max_num_seqs, max_blocks_per_seq)
        # The host side of the copies: pinned on CUDA (asynchronous copies); on CPU, the buffers themselves.
        # Reusing pinned memory next step is safe: every step ends with a sync on its sampled tokens.
        self._on_device = device.type != "cpu"
        self._host_tokens = self.tokens.cpu().pin_memory() if self._on_device else self.tokens
        self._host_lens_tables = self.lens_tables.cpu().pin_memory() if self._on_device else self.lens_tables
        self._host_block_tables = self._host_lens_tables[max_num_seqs:].view(max_num_seqs, max_blocks_per_seq)

    def load(self, seqs: list[Sequence], batch_size: int) -> int:
        """Copy the decode inputs of `seqs` into rows [0, batch_size); returns the longest context."""
        block_size, scratch, pad = self.block_size, self.scratch_block, batch_size - len(seqs)
        token_rows: list[list[int]] = [[], [], []]
        context_lens: list[int] = []
        for seq in seqs:
            position = len(seq) - 1
            token_rows[0].append(seq.last_token_id)
            token_rows[1].append(position)
            token_rows[2].append(seq.block_table[position // block_size] * block_size + position % block_size)
            context_lens.append(len(seq))
        token_rows[0] += [0] * pad
        token_rows[1] += [0] * pad
        token_rows[2] += [scratch * block_size] * pad
        width = max(len(seq.block_table) for seq in seqs)
        tables = [seq.block_table + [scratch] * (width - len(seq.block_table)) for seq in seqs]
        tables += [[scratch] * width] * pad
        # numpy builds these from lists ~3x faster than torch.tensor (host time between two decode steps)
        self._host_tokens[:, :batch_size] = torch.from_numpy(np.array(token_rows, dtype=np.int64))
        self._host_lens_tables[:batch_size] = torch.from_numpy(np.array(context_lens + [0] * pad, dtype=np.int32))
        self._host_block_tables[:batch_size, :width] = torch.from_numpy(np.array(tables, dtype=np.int32))
        if self._on_device:
            self.tokens.copy_(self._host_tokens, non_blocking=True)  # whole (contiguous), a few KB
            self.lens_tables[:batch_size].copy_(self._host_lens_tables[:batch_size], non_blocking=True)
            self.block_tables[:batch_size].copy_(self._host_block_tables[:batch_size], non_blocking=True)
        return max(context_lens)

    def inputs(self, batch_size: int, max_context_len: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) views of the first `batch_size` rows."""
        metadata = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.tokens[2, :batch_size],
            context_lens=self.lens_tables[:batch_size],
            block_tables=self.block_tables[:batch_size],
            cu_seqlens_q=None,
            max_context_len=max_context_len,
        )
        return self.tokens[0, :batch_size], self.tokens[1, :batch_size], metadata
