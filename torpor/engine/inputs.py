"""The model inputs of one step: a packed prefill batch (fresh tensors), or the persistent decode buffers
that CUDA graphs read at fixed addresses."""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import numpy as np
import torch

from torpor.engine.attention.metadata import AttentionMetadata
from torpor.engine.sequence import Sequence

_LAST = operator.itemgetter(-1)


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


MIN_PREFIX_TOKENS = 64  # a shorter prompt gives no shared prefix: its one split would cost more than it saves


def prefix_groups(prefix_blocks: np.ndarray, tables: np.ndarray, max_members: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequences that share a prefix, for the decode kernel: rows with the same number of prefix blocks (> 0)
    and the same blocks over them form a group, cut into groups of at most `max_members`; every other row is a
    group of its own. Groups come in the order of their first row, members in row order. prefix_blocks:
    [n] ints; tables: [n, >= max(prefix_blocks)] block ids. Returns (starts [n + 1], members [n]) int32, the
    unused groups at the end empty (start == end == n).

    Rows are matched by (prefix length, last prefix block) first, then every row's prefix is compared whole
    with its match's: with prefix caching a block at a position implies the blocks before it, but a row is
    only ever grouped on equal blocks (1-D keys: ~0.1 ms for 512 rows, where whole-row keys took ~5 ms)."""
    n = len(prefix_blocks)
    rows = np.arange(n)
    has_prefix = prefix_blocks > 0
    last = tables[rows, np.maximum(prefix_blocks - 1, 0)].astype(np.int64)
    keys = np.where(has_prefix, prefix_blocks.astype(np.int64) << 32 | last, -1 - rows)  # none: a key of its own
    _, first, group_of = np.unique(keys, return_index=True, return_inverse=True)
    width = int(prefix_blocks.max(initial=0))
    if width:
        leader = first[group_of.reshape(-1)]
        inside = np.arange(width) < prefix_blocks[:, None]
        differs = ((tables[:, :width] != tables[leader, :width]) & inside).any(axis=1)
        if differs.any():  # blocks that do not imply their predecessors: such rows alone
            keys = np.where(differs, -1 - rows, keys)
            _, first, group_of = np.unique(keys, return_index=True, return_inverse=True)
    group_of = np.argsort(np.argsort(first))[group_of.reshape(-1)]  # groups numbered by their first row
    members = np.argsort(group_of, kind="stable")  # rows, group by group, in row order
    rank = rows - np.searchsorted(group_of[members], group_of[members])  # place within its group
    starts = np.full(n + 1, n, dtype=np.int32)
    first_rows = np.flatnonzero(rank % max_members == 0)  # a group starts, or a full one is cut
    starts[: len(first_rows)] = first_rows
    return starts, members.astype(np.int32)


class DecodeBuffers:
    """Inputs of decode steps at fixed addresses (allocate in the runtime memory scope): a step copies
    its batch in, padded to `batch_size` rows; padded rows write their K/V to a scratch slot and attend
    to nothing (context length 0). `hidden` receives the model's output (a CUDA graph's output buffer).

    With `max_group_members` > 0 (the GPU backend's decode kernel) each row also has its shared prefix: the
    full blocks of its prompt (prefix caching gives the n samples of a prompt, and prompts found in the cache,
    the same blocks), and the rows are grouped by identical prefixes (`prefix_groups`), recomputed only when the
    batch's rows change. A row's prefix depends on its own prompt only, never on what shares its batch."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, block_size: int, scratch_block: int, max_group_members: int = 0) -> None:
        self.max_num_seqs, self.block_size, self.scratch_block = max_num_seqs, block_size, scratch_block
        self.max_group_members = max_group_members
        # Rows: input ids, positions, slot mapping.
        self.tokens = torch.zeros(3, max_num_seqs, dtype=torch.int64, device=device)
        self.tokens[2].fill_(scratch_block * block_size)
        # int32: context lengths, prefix lengths, group starts (+1), group members (a header copied whole),
        # then block tables. Every row starts as a group of its own with no prefix.
        s = max_num_seqs
        self._header = 4 * s + 1
        self.lens_tables = torch.zeros(self._header + s * max_blocks_per_seq, dtype=torch.int32, device=device)
        self.lens_tables[2 * s : 3 * s + 1] = torch.arange(s + 1, dtype=torch.int32)
        self.lens_tables[3 * s + 1 : 4 * s + 1] = torch.arange(s, dtype=torch.int32)
        self.hidden = torch.zeros(max_num_seqs, hidden_size, dtype=dtype, device=device)
        self.block_tables = self.lens_tables[self._header:].view(max_num_seqs, max_blocks_per_seq)
        # The host side of the copies: pinned on CUDA (asynchronous copies); on CPU, the buffers themselves.
        # Reusing pinned memory next step is safe: every step ends with a sync on its sampled tokens.
        self._on_device = device.type != "cpu"
        self._host_tokens = self.tokens.cpu().pin_memory() if self._on_device else self.tokens
        self._host_lens_tables = self.lens_tables.cpu().pin_memory() if self._on_device else self.lens_tables
        self._host_block_tables = self._host_lens_tables[self._header:].view(max_num_seqs, max_blocks_per_seq)
        # numpy views of the host side (written in place, no tensor made per step)
        self._host_tokens_np = self._host_tokens.numpy()
        header = self._host_lens_tables[: self._header].numpy()
        self._host_lens_np, self._host_prefix_np = header[:s], header[s : 2 * s]
        self._host_starts_np, self._host_members_np = header[2 * s : 3 * s + 1], header[3 * s + 1 :]
        self._host_tables_np = self._host_block_tables.numpy()
        self._table_rows = BlockTableRows(max_num_seqs, max_blocks_per_seq, scratch_block)
        if max_group_members:
            from torpor.engine.attention.triton_decode import DecodePrefixes  # the GPU kernel's (imports triton)

            self._prefixes_type = DecodePrefixes
        self._grouped: tuple[int, list[int]] | None = None  # the rows' generation and ids the groups were made for
        self._groups: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # prefix lens, starts, members

    def load(self, seqs: list[Sequence], batch_size: int) -> int:
        """Copy the decode inputs of `seqs` into rows [0, batch_size); returns the longest context.
        (Vectorized: this runs between two decode steps, while the GPU waits.)"""
        num_seqs, block_size, scratch = len(seqs), self.block_size, self.scratch_block
        if isinstance(seqs[0], Sequence):  # read the token lists: no Python call per sequence
            token_lists = [seq.token_ids for seq in seqs]
            lens = np.fromiter(map(len, token_lists), dtype=np.int64, count=num_seqs)
            last_tokens = list(map(_LAST, token_lists))
        else:  # a tensor-parallel worker's views (step_batch.StepSequence)
            lens = np.fromiter([len(seq) for seq in seqs], dtype=np.int64, count=num_seqs)
            last_tokens = [seq.last_token_id for seq in seqs]
        positions = lens - 1
        rows, width = self._table_rows.update(seqs)
        tables = self._host_tables_np[:batch_size, :width]
        tables[:num_seqs] = self._table_rows.rows[rows, :width]
        tables[num_seqs:] = scratch
        tokens = self._host_tokens_np[:, :batch_size]
        tokens[0, :num_seqs] = last_tokens
        tokens[1, :num_seqs] = positions
        blocks = tables[np.arange(num_seqs), positions // block_size].astype(np.int64)
        tokens[2, :num_seqs] = blocks * block_size + positions % block_size
        tokens[:, num_seqs:] = ((0,), (0,), (scratch * block_size,))
        self._host_lens_np[:num_seqs] = lens
        self._host_lens_np[num_seqs:batch_size] = 0
        if self.max_group_members:
            self._load_groups(seqs, rows, tables, batch_size)
        if self._on_device:
            self.tokens.copy_(self._host_tokens, non_blocking=True)  # whole (contiguous), a few KB
            header = self._header if self.max_group_members else batch_size
            self.lens_tables[:header].copy_(self._host_lens_tables[:header], non_blocking=True)
            self.block_tables[:batch_size].copy_(self._host_block_tables[:batch_size], non_blocking=True)
        return int(lens.max())

    def _load_groups(self, seqs: list, rows: list[int], tables: np.ndarray, batch_size: int) -> None:
        """Prefix lengths and groups of rows [0, batch_size) into the host header (padding: alone, no prefix)."""
        num_seqs = len(seqs)
        key = (self._table_rows.generation, rows)  # a row id may pass to a new sequence: generation tells
        if key != self._grouped or self._groups is None:
            prompts = np.fromiter([seq.num_prompt_tokens for seq in seqs], dtype=np.int64, count=num_seqs)
            prefix_blocks = np.where(prompts >= MIN_PREFIX_TOKENS, prompts // self.block_size, 0)
            self._groups = (prefix_blocks * self.block_size, *prefix_groups(
                prefix_blocks, tables[:num_seqs], self.max_group_members))
            self._grouped = key
        prefix_lens, starts, members = self._groups
        num_groups = int(np.searchsorted(starts, num_seqs))  # starts[g] < num_seqs for the groups in use
        self._host_prefix_np[:num_seqs] = prefix_lens
        self._host_prefix_np[num_seqs:batch_size] = 0
        self._host_starts_np[:num_groups] = starts[:num_groups]
        padding = np.arange(num_seqs, batch_size + 1)  # each padded row a group of its own, then empty groups
        self._host_starts_np[num_groups : num_groups + len(padding)] = padding
        self._host_starts_np[num_groups + len(padding) : batch_size + 1] = batch_size
        self._host_members_np[:num_seqs] = members
        self._host_members_np[num_seqs:batch_size] = padding[:-1]

    def inputs(self, batch_size: int, max_context_len: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) views of the first `batch_size` rows."""
        s = self.max_num_seqs
        prefixes = None
        if self.max_group_members:
            prefixes = self._prefixes_type(self.lens_tables[s : s + batch_size],
                                      self.lens_tables[2 * s : 2 * s + batch_size + 1],
                                      self.lens_tables[3 * s + 1 : 3 * s + 1 + batch_size])
        metadata = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.tokens[2, :batch_size],
            context_lens=self.lens_tables[:batch_size],
            block_tables=self.block_tables[:batch_size],
            cu_seqlens_q=None,
            max_context_len=max_context_len,
            prefixes=prefixes,
        )
        return self.tokens[0, :batch_size], self.tokens[1, :batch_size], metadata


class BlockTableRows:
    """The block tables of the running sequences, kept on the host between decode steps: each table has a
    row (its blocks, then the scratch block) written as it grows, so a step copies only the blocks added
    since the last one instead of rebuilding every table (~40 blocks x 512 sequences per step).

    A row belongs to one `block_table` list (by identity; the row keeps it referenced, so its id stays
    unique): the block manager only appends to a table (`may_append`) or gives the sequence a new list
    (allocate, fork, deallocate), never changes an entry in place. So a row is up to date while it holds as
    many entries as its list, and a sequence with a new list gets a new row. Rows of lists no longer in the
    batch are freed whenever the batch's membership changes."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, scratch_block: int) -> None:
        self.scratch_block = scratch_block
        self.rows = np.full((max_num_seqs, max_blocks_per_seq), scratch_block, dtype=np.int32)
        self._row_of: dict[int, int] = {}                   # id(block table list) -> its row
        self._table: list[list[int] | None] = [None] * max_num_seqs  # the list a row copies
        self._written = [0] * max_num_seqs                  # entries of it written
        self._free = list(range(max_num_seqs - 1, -1, -1))  # popped from the end: lowest rows first
        self.generation = 0  # counts the changes of membership: a row id can pass from one list to another

    def update(self, seqs: list) -> tuple[list[int], int]:
        """Bring the rows of `seqs`' block tables up to date; returns their rows and the longest table's length.
        (map over C functions: no Python call per sequence in the common step, where nothing changed.)"""
        tables = [seq.block_table for seq in seqs]
        row_of = self._row_of
        rows = list(map(row_of.get, map(id, tables)))
        if len(row_of) != len(tables) or None in rows:  # the batch's membership changed
            rows = self._assign(tables)
        lengths = list(map(len, tables))
        written = list(map(self._written.__getitem__, rows))
        if lengths != written:
            self._write(tables, rows, written)
        return rows, max(lengths)

    def _assign(self, tables: list[list[int]]) -> list[int]:
        """Free the rows of lists not in `tables`, give a row to each new one; returns the rows of `tables`."""
        self.generation += 1
        batch = set(map(id, tables))
        freed = [self._row_of.pop(key) for key in [key for key in self._row_of if key not in batch]]
        for row in freed:
            self._table[row], self._written[row] = None, 0
        self.rows[freed] = self.scratch_block
        self._free += freed
        for table in tables:
            if id(table) not in self._row_of:
                row = self._row_of[id(table)] = self._free.pop()
                self._table[row] = table
        return [self._row_of[id(table)] for table in tables]

    def _write(self, tables: list[list[int]], rows: list[int], written: list[int]) -> None:
        """Write the entries each row lacks, in one scatter."""
        row_ids: list[int] = []
        columns: list[int] = []
        values: list[int] = []
        for table, row, start in zip(tables, rows, written, strict=True):
            if len(table) != start:
                row_ids += [row] * (len(table) - start)
                columns += range(start, len(table))
                values += table[start:]
                self._written[row] = len(table)
        self.rows[row_ids, columns] = values
