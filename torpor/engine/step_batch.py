"""What a tensor-parallel worker needs of one scheduled batch, packed small (torch-free).

Rank 0 schedules and samples; the workers only run the forward pass. Pickling whole `Sequence`s sent
every token of every sequence (and its logprobs) to every worker at every step: 2.1 MiB per step at 256
sequences x 2k tokens, 7.4 MiB with logprobs. A `StepBatch` carries only the tokens the step computes,
the lengths and the block tables, as flat `array`s (pickled as raw bytes), and the prompt-logprob
requests of a prefill. The worker rebuilds light `StepSequence` views that have the attributes the model
runner's input preparation reads.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from torpor.engine.sampling_params import SamplingParams


@dataclass
class StepBatch:
    is_prefill: bool
    num_tokens: array          # 'i' [num_seqs]: len(seq)
    num_cached_tokens: array   # 'i' [num_seqs]: tokens whose K/V are already cached
    new_token_ids: array       # 'i' [sum of num_tokens - num_cached_tokens]: what this step computes
    block_counts: array        # 'i' [num_seqs]
    block_tables: array        # 'i' [sum of block_counts], concatenated
    num_prompt_tokens: array   # 'i' [num_seqs] (decode: where each shared prompt prefix ends)
    # Prefill only: request ids and sample indices (for error messages), the sampling params
    # of the sequences whose prompt logprobs this step computes (None elsewhere: nothing else is read), and
    # the forked samples of n-sample requests (they share their parent's prefill; their last prompt block
    # is copied: (source, destination)).
    request_ids: list[str] | None = None
    indices: list[int] | None = None
    params: list[SamplingParams | None] | None = None
    shares_prefill: list[bool] | None = None
    fork_copies: list[tuple[int, int] | None] | None = None

    @classmethod
    def pack(cls, seqs: list, is_prefill: bool) -> StepBatch:
        """From rank 0's scheduled `Sequence`s."""
        new_token_ids, block_tables = array("i"), array("i")
        for seq in seqs:
            new_token_ids.extend(seq.token_ids[seq.num_cached_tokens:])
            block_tables.extend(seq.block_table)
        batch = cls(is_prefill, array("i", [len(s) for s in seqs]), array("i", [s.num_cached_tokens for s in seqs]),
                    new_token_ids, array("i", [len(s.block_table) for s in seqs]), block_tables,
                    array("i", [s.num_prompt_tokens for s in seqs]))
        if is_prefill:
            batch.request_ids, batch.indices = [s.request_id for s in seqs], [s.index for s in seqs]
            batch.shares_prefill, batch.fork_copies = [s.shares_prefill for s in seqs], [s.fork_copy for s in seqs]
            batch.params = [s.sampling_params if s.prompt_logprobs is None and s.sampling_params.prompt_logprobs
                            is not None else None for s in seqs]
        return batch

    def sequences(self) -> list[StepSequence]:
        """The worker's views, in batch order."""
        views, token_at, block_at = [], 0, 0
        for i, (num_tokens, num_cached, num_blocks) in enumerate(
                zip(self.num_tokens, self.num_cached_tokens, self.block_counts, strict=True)):
            num_new = num_tokens - num_cached
            view = StepSequence(num_tokens, num_cached, self.new_token_ids[token_at:token_at + num_new].tolist(),
                                self.block_tables[block_at:block_at + num_blocks].tolist())
            view.num_prompt_tokens = self.num_prompt_tokens[i]
            if self.is_prefill:
                view.request_id, view.index = self.request_ids[i], self.indices[i]
                view.shares_prefill, view.fork_copy = self.shares_prefill[i], self.fork_copies[i]
                if self.params[i] is not None:
                    view.sampling_params = self.params[i]
            views.append(view)
            token_at, block_at = token_at + num_new, block_at + num_blocks
        return views


class StepSequence:
    """A worker's view of one scheduled sequence: its length, the tokens this step computes (positions
    `num_cached_tokens`..), its block table. Positions below `num_cached_tokens` read as 0 in `token_ids`:
    nothing on a worker reads them (their K/V are cached)."""

    _NO_PROMPT_LOGPROBS = SamplingParams()

    def __init__(self, num_tokens: int, num_cached_tokens: int, new_token_ids: list[int], block_table: list[int]):
        self.num_cached_tokens, self.block_table = num_cached_tokens, block_table
        self._num_tokens, self._new_token_ids = num_tokens, new_token_ids
        self.request_id, self.index, self.num_prompt_tokens = "", 0, 0
        self.sampling_params = self._NO_PROMPT_LOGPROBS
        self.prompt_logprobs = None
        self.shares_prefill, self.fork_copy = False, None

    @property
    def seq_id(self) -> tuple[str, int]:
        return self.request_id, self.index

    def __len__(self) -> int:
        return self._num_tokens

    @property
    def token_ids(self) -> list[int]:
        return [0] * self.num_cached_tokens + self._new_token_ids

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def last_token_id(self) -> int:
        return self._new_token_ids[-1]
