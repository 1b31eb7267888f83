"""One request's lifecycle state: tokens, KV blocks, status and results (torch-free)."""

from __future__ import annotations

from enum import Enum, auto
from typing import Literal

from torpor.engine.routed_experts import RoutedExperts
from torpor.engine.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort"]
# Logprobs of one position: token id -> logprob for the top-k tokens plus the actual token
# (the chosen output token, or the real next prompt token). Values are float32 rounded to float.
TokenLogprobs = dict[int, float]

_MASK64 = (1 << 64) - 1
_SEED_STRIDE = 0x9E3779B97F4A7C15  # golden-ratio increment: the samples' seeds are far apart


def sample_seed(seed: int, index: int) -> int:
    """The sampling seed of sample `index` of a request seeded `seed` (sample 0 uses `seed` itself, so
    n=1 and the first of n samples draw the same tokens)."""
    return seed if index == 0 else (seed + index * _SEED_STRIDE) & _MASK64


class SequenceStatus(Enum):
    WAITING = auto()    # queued, or preempted: holds no KV blocks
    RUNNING = auto()    # holds KV blocks for its tokens
    FINISHED = auto()   # done; blocks returned


# (A module constant: reading an Enum member through its class costs a metaclass lookup, per sequence per step.)
FINISHED = SequenceStatus.FINISHED


class Sequence:
    """A request being served.

    KV-cache invariant: the first `num_cached_tokens` tokens have their K/V in the blocks of
    `block_table`; the next forward pass computes `token_ids[num_cached_tokens:]` (the whole
    sequence at prefill, the last token at decode). Preemption drops the blocks and resets
    `num_cached_tokens` to 0, so the next prefill recomputes prompt and outputs (from the first block the
    prefix cache does not hold). The prompt was validated by `LLMEngine.make_sequence`.

    A request with n samples is n sequences with the same `request_id` and `index` 0..n-1 (`seq_id` tells
    them apart). Sample 0 is queued with the others in `pending_forks`; the prefill that computes its
    prompt forks them (see Scheduler), and for that one step they are `shares_prefill`: the step samples
    their first token from sample 0's logits.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams | None = None, prompt: str | None = None, index: int = 0):
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
        # return_routed_experts: the experts each output token's forward pass chose ([layers, top_k] per token)
        self.routed_experts: RoutedExperts | None = RoutedExperts() if self.sampling_params.return_routed_experts \
            else None
        self.cumulative_logprob = 0.0                         # sum of the sampled tokens' logprobs (when computed)
        # Set once by the engine at the first prefill; a recompute after preemption keeps it.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.arrival = -1                                     # set by Scheduler.add
        # Counter-based sampling seed (see sampler.py); Scheduler.add fills it when unseeded.
        self.sampling_seed: int | None = (None if self.sampling_params.seed is None
                                          else sample_seed(self.sampling_params.seed, index))
        self.index = index                                    # sample index within the request
        self.pending_forks: list[Sequence] = []               # samples 1..n-1 until the prompt's prefill
        self.shares_prefill = False                           # forked this step: no tokens of its own to compute
        self.fork_copy: tuple[int, int] | None = None         # (source, destination) block copied at the fork
        # Prefix caching (see BlockManager): keys of the full blocks of token_ids, grown as blocks fill;
        # how many of this sequence's blocks are registered in the cache; the cache generation they
        # belong to; the prompt tokens found in the cache at the first prefill (RequestOutput's field).
        self.block_keys: list[bytes] = []
        self.num_registered_blocks = 0
        self.cache_epoch = -1
        self.num_prefix_cached_tokens = 0
        # The weights that sampled the output tokens: (label, first output index) each time the label changed
        # (a list that grows only then: one comparison per token), read as spans by `weight_version_spans`.
        self.weight_version_starts: list[tuple[str, int]] = []
        self._weight_version: str | None = None

    @property
    def seq_id(self) -> tuple[str, int]:
        """Unique among the engine's sequences: (request id, sample index)."""
        return self.request_id, self.index

    def fork(self, index: int) -> Sequence:
        """A fresh sample `index` of this (sample 0's) request: same prompt and params, its own seed."""
        if self.index != 0:
            raise RuntimeError(f"only sample 0 forks, not sample {self.index} of {self.request_id!r}")
        child = Sequence(self.request_id, self.prompt_token_ids, self.sampling_params, self.prompt, index)
        child.sampling_seed = None if self.sampling_seed is None else sample_seed(self.sampling_seed, index)
        return child

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
        return self.status is FINISHED

    def weight_version_spans(self) -> list[tuple[str, int, int]]:
        """(label, start, end): output tokens [start, end) were sampled by the weights of that label, in order,
        covering every output token ([] before the first)."""
        starts, spans = self.weight_version_starts, []
        for i, (version, start) in enumerate(starts):
            spans.append((version, start, starts[i + 1][1] if i + 1 < len(starts) else self.num_output_tokens))
        return spans

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None = None, routed_experts=None,
                     weight_version: str | None = None) -> None:
        """Record a sampled token (with its logprobs, the experts its forward pass chose: a numpy [layers,
        top_k], and the label of the weights that sampled it); every token computed so far is now in the KV
        cache."""
        if weight_version is not None and weight_version != self._weight_version:
            self.weight_version_starts.append((weight_version, self.num_output_tokens))
            self._weight_version = weight_version
        self.num_cached_tokens = len(self.token_ids)
        self.shares_prefill, self.fork_copy = False, None
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token_id]
        if routed_experts is not None and self.routed_experts is not None:
            self.routed_experts.append(routed_experts)
