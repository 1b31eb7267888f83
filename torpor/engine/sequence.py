"""One request's lifecycle state: tokens, KV blocks, status and results (torch-free)."""

from __future__ import annotations

from enum import Enum, auto
from typing import Literal

from torpor.engine.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort"]
# Logprobs of one position: token id -> logprob for the top-k tokens plus the actual token
# (the chosen output token, or the real next prompt token). Values are float32 rounded to float.
TokenLogprobs = dict[int, float]


class SequenceStatus(Enum):
    WAITING = auto()    # queued, or preempted: holds no KV blocks
    RUNNING = auto()    # holds KV blocks for its tokens
    FINISHED = auto()   # done; blocks returned


class Sequence:
    """A request being served.

    KV-cache invariant: the first `num_cached_tokens` tokens have their K/V in the blocks of
    `block_table`; the next forward pass computes `token_ids[num_cached_tokens:]` (the whole
    sequence at prefill, the last token at decode). Preemption drops the blocks and resets
    `num_cached_tokens` to 0, so the next prefill recomputes prompt and outputs. The prompt was
    validated by `LLMEngine.make_sequence`.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams | None = None, prompt: str | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.sampling_params = sampling_params or SamplingParams()
        self.token_ids: list[int] = list(prompt_token_ids)    # prompt, then outputs
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.output_logprobs: list[TokenLogprobs] = []
        # Set once by the engine at the first prefill; a recompute after preemption keeps it.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.arrival = -1                                     # set by Scheduler.add
        # Counter-based sampling seed (see sampler.py); Scheduler.add fills it when unseeded.
        self.sampling_seed: int | None = self.sampling_params.seed

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"outputs={self.num_output_tokens}, blocks={len(self.block_table)})")

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_new_tokens(self) -> int:
        """Tokens the next forward pass computes (all uncached ones)."""
        return len(self.token_ids) - self.num_cached_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        """Record a sampled token; every token computed so far is now in the KV cache."""
        self.num_cached_tokens = len(self.token_ids)
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
