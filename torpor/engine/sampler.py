"""Token sampling and logprobs, vectorized over the batch.

Reproducibility. A sampled token is chosen by inverse-CDF sampling with ONE random number per
sequence, derived on the host from (sampling_seed, output step) by a counter-based hash
(splitmix64). So a seeded request draws the same numbers whatever shares its batch, after
preemption and recompute, and across sleep/wake; no generator state exists to save or restore.
The CDF is an exact int64 prefix sum of the probabilities quantized to multiples of 2^-36
(a float cumsum is non-deterministic on CUDA), so the pick is bit-reproducible on each device.
Tokens below 2^-36 probability are never drawn; that truncation moves < vocab * 2^-36 of mass.
The random number has 52 bits, so every other token is drawn with its quantized probability to
within 2^-52 (26 bits drew a token below 2^-26 with probability 0 or 2^-26: on a 152k vocabulary
~3e-4 of the mass moved per token drawn).

The search never builds that prefix sum over the whole vocabulary: integer sums are
exact in any order, so the first column whose cumulative weight passes the target is found from sums of
blocks of columns, then a cumsum inside the one block that holds it (`_search_blocks`; on CUDA two
Triton kernels that read the float32 probabilities once, sampler_kernels.py). The token is the full
cumsum's, bit for bit, for every input (NaN rows included: see sampler_kernels.py); the old draw is kept
as the tests' reference (tests/references.py). The top-k/top-p path keeps its full cumsums (its sort costs
more). A batch whose temperatures are all 1.0 skips the division (x / 1.0 == x). Logprobs reach the host
in the same single copy as the token ids.

CUDA graphs. The sampler runs eagerly on the graph's logits output: whether a batch needs the
sort for top-k/top-p is a host decision per step (capturing each combination would multiply
graph memory), and it is a handful of kernels next to the model's hundreds. It makes no host
sync before the final copy of the token ids, and its per-step inputs live in one persistent
buffer (allocate the Sampler inside the runtime memory tag), so capturing it later stays open.

Logprobs are log_softmax of the *unmodified* logits (before every option below): the model's own
distribution, comparable across sampling settings (vLLM's default "raw" logprobs).

Logits processing (vLLM's order), only for the rows of requests that ask for it: logit_bias is added;
min_tokens masks the stop tokens (eos unless ignore_eos, stop_token_ids) to -inf; repetition_penalty
divides positive / multiplies negative logits of every token of the prompt and the output so far;
frequency_penalty and presence_penalty subtract per output occurrence / once. These steer greedy picks
too. Then temperature, min_p (relative to the most likely token), top-k, top-p, the draw. Every step is
row-wise, so a request's tokens do not depend on what shares its batch. A batch in which no request uses
these options runs exactly the code it ran before them (one `any` over the params decides).

Token history. The penalties read each request's tokens so far from `TokenHistory`: per-request rows of
token ids kept on the device, allocated once at start-up (in the runtime tag) and grown by one token per
step, instead of [max_num_seqs, vocab] count tensors: max_num_seqs * max_model_len * 4 bytes (256 x 4096:
4 MiB) against max_num_seqs * vocab * 5 bytes (256 x 151936 Qwen vocab: 186 MiB) held by every engine.
The counts are rebuilt per step by a scatter over the penalized rows only (a temporary).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from torpor.engine.outputs import TokenLogprobs
from torpor.engine.sampling_params import SamplingParams
from torpor.engine.sequence import Sequence

_MASK64 = (1 << 64) - 1
_RANDOM_BITS = 52          # the uniform number per sequence: an int in [0, 2^52) (exact in float64)
_HALF_BITS = _RANDOM_BITS // 2
_PROB_SCALE = 2.0 ** 36    # probability quantum; total * 2^26 stays below 2^63 (no overflow)
_PROMPT_CHUNK = 512        # prompt positions per log_softmax, to bound temporary memory
_SEARCH_BLOCK = 256        # columns per block sum of the CPU draw (`_search_blocks`; 256-512 were fastest)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def random_bits(seed: int, step: int) -> int:
    """The random integer in [0, 2^52) for output token `step` of a request seeded `seed`."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ step) >> (64 - _RANDOM_BITS)


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """`_splitmix64` of every element of a uint64 array (numpy's uint64 arithmetic wraps: mod 2^64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def random_bits_batch(seeds: list[int], steps: list[int]) -> list[int]:
    """`random_bits(seed, step)` of every pair at once (one decode step's batch: 512 pairs in ~30 us
    instead of ~0.5 ms one by one)."""
    return random_bits_mixed(mixed_seeds(seeds), steps).tolist()


def mixed_seeds(seeds: list[int]) -> np.ndarray:
    """The seed half of `random_bits`: splitmix64 of each seed (mod 2^64), as uint64 (kept across steps)."""
    return _splitmix64_array(np.array([seed & _MASK64 for seed in seeds], dtype=np.uint64))


def random_bits_mixed(mixed: np.ndarray, steps: list[int]) -> np.ndarray:
    """`random_bits(seed, step)` of every pair, from `mixed_seeds(seeds)`: uint64 in [0, 2^52)."""
    return _splitmix64_array(mixed ^ np.array(steps, dtype=np.uint64)) >> np.uint64(64 - _RANDOM_BITS)


class BatchParams:
    """The per-batch facts the sampler reads from the sampling params of a batch (row i: sequence i)."""

    def __init__(self, params: list[SamplingParams], vocab_size: int) -> None:
        self.params, self.vocab_size = params, vocab_size
        self.needs_logits_processing = any(p.needs_logits_processing for p in params)
        self.num_greedy = sum(p.is_greedy for p in params)
        self.logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        self.use_min_p = any(p.min_p > 0 for p in params)
        self.filters = [p.needs_filter for p in params]
        # The sampling inputs that do not change between steps; row 3 (the random bits) is filled per step.
        self.rows = np.array([
            [1.0 if p.is_greedy else p.temperature for p in params],  # greedy rows are discarded
            [p.top_p for p in params],
            [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params],
            [0.0] * len(params),
            [p.min_p for p in params],
        ], dtype=np.float64)
        # Rows whose temperature is exactly 1.0 once rounded to float32 (as the draw divides): x / 1.0 == x.
        self.unit_temperature = self.rows[0].astype(np.float32) == 1.0


@dataclass
class SamplerOutput:
    token_ids: list[int]                        # one per sequence
    logprobs: list[TokenLogprobs | None]        # None where params.logprobs is None
    # MoE: per sequence, the [moe layers, top_k] experts chosen (numpy) where params.return_routed_experts, else
    # None; None when no sequence asked (filled by the model runner: routing_recorder.py)
    routed_experts: list | None = None


class Sampler:
    """Picks the next token of every sequence from its float32 logits. `max_model_len` sizes the token
    history of the penalties (0: no history, penalties are refused); `eos_token_ids` are what min_tokens
    holds back. Construct it inside the runtime memory tag: its buffers are per-request state."""

    def __init__(self, max_num_seqs: int, device: torch.device | str = "cpu", max_model_len: int = 0,
                 eos_token_ids: Iterable[int] = ()):
        self.device = torch.device(device)
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        # Rows: temperature, top_p, top_k, random bits, min_p (all exact in float64). One host->device
        # copy per step; the host side is pinned on CUDA so the copy is asynchronous (reusing it
        # next step is safe: each call ends by syncing on the token ids).
        self._inputs = torch.zeros(5, max_num_seqs, dtype=torch.float64, device=self.device)
        self._staging = torch.zeros(5, max_num_seqs, dtype=torch.float64,
                                    pin_memory=self.device.type == "cuda")
        self._staging_np = self._staging.numpy()  # written in place: no array or tensor made per step
        self._batch: BatchParams | None = None     # the last batch's params, reused while they stay the same
        self._seeds: list[int | None] = []         # the last batch's seeds, and their first splitmix64 round
        self._mixed_seeds = np.zeros(0, dtype=np.uint64)
        self.history = TokenHistory(max_num_seqs, max_model_len, self.device)

    @staticmethod
    def state_bytes(max_num_seqs: int, max_model_len: int) -> int:
        """Device bytes a Sampler allocates (what start-up must leave free after the KV cache)."""
        return 5 * max_num_seqs * 8 + TokenHistory.state_bytes(max_num_seqs, max_model_len)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """logits: [num_seqs, vocab] float32, row i for seqs[i]."""
        num_seqs = len(seqs)
        if logits.dim() != 2 or logits.shape[0] != num_seqs or logits.dtype != torch.float32:
            raise ValueError(f"logits must be float32 [{num_seqs}, vocab], got "
                             f"{logits.dtype} {list(logits.shape)}")
        if num_seqs > self._inputs.shape[1]:
            raise ValueError(f"{num_seqs} sequences exceed max_num_seqs ({self._inputs.shape[1]})")
        batch = self._batch_params(seqs, logits.shape[1])
        params = batch.params
        raw_logits = logits  # logprobs are those of the model's own distribution
        if batch.needs_logits_processing:
            logits = self._process_logits(logits, seqs)
        if batch.num_greedy == num_seqs:
            token_ids = logits.argmax(dim=-1)                               # [num_seqs]
        elif batch.num_greedy == 0:  # (torch.where over no greedy row would pick these unchanged)
            token_ids = self._sample(logits, seqs, batch)
        else:
            sampled = self._sample(logits, seqs, batch)
            is_greedy = torch.tensor([p.is_greedy for p in params]).to(logits.device, non_blocking=True)
            token_ids = torch.where(is_greedy, logits.argmax(dim=-1), sampled)
        if not batch.logprob_rows:
            return SamplerOutput(token_ids.tolist(), [None] * num_seqs)
        return self._with_logprobs(raw_logits, token_ids, batch)

    def _with_logprobs(self, raw_logits: torch.Tensor, token_ids: torch.Tensor, batch: BatchParams) -> SamplerOutput:
        """The step's output with each requesting row's logprobs (of the model's own distribution: `raw_logits`
        [num_seqs, vocab], before any logits processing); token_ids: [num_seqs], the tokens picked."""
        logprob_rows, num_seqs = batch.logprob_rows, raw_logits.shape[0]
        num_top = [batch.params[i].logprobs for i in logprob_rows]
        if len(logprob_rows) == num_seqs:
            values = _logprob_values(raw_logits, token_ids, max(num_top))
        else:
            rows = torch.tensor(logprob_rows).to(raw_logits.device, non_blocking=True)
            values = _logprob_values(raw_logits.index_select(0, rows), token_ids.index_select(0, rows), max(num_top))
        host_ids, *host_values = _to_host([token_ids, *values])  # the step's one device -> host copy
        token_list = host_ids.tolist()
        chosen_ids = token_list if len(logprob_rows) == num_seqs else [token_list[i] for i in logprob_rows]
        logprobs: list[TokenLogprobs | None] = [None] * num_seqs
        for i, d in zip(logprob_rows, _build_dicts(chosen_ids, host_values, num_top), strict=True):
            logprobs[i] = d
        return SamplerOutput(token_list, logprobs)

    def _process_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """A copy of `logits` with logit_bias, min_tokens and the penalties applied to the rows that use
        them (the other rows are copied unchanged). Row-wise only: batch-independent."""
        logits = logits.clone()
        biases = [(i, t, b) for i, seq in enumerate(seqs) for t, b in seq.sampling_params.logit_bias]
        if biases:
            rows, ids, values = zip(*biases, strict=True)
            index = torch.tensor([rows, ids]).to(logits.device, non_blocking=True)
            bias = torch.tensor(values, dtype=torch.float32).to(logits.device, non_blocking=True)
            logits.index_put_((index[0], index[1]), logits[index[0], index[1]] + bias)
        banned = [(i, t) for i, seq in enumerate(seqs) for t in self._held_back(seq)]
        if banned:
            index = torch.tensor(banned).T.to(logits.device, non_blocking=True)
            logits.index_put_((index[0], index[1]), torch.tensor(-torch.inf, device=logits.device))
        penalized = [i for i, seq in enumerate(seqs) if seq.sampling_params.needs_history]
        if penalized:
            self._apply_penalties(logits, [seqs[i] for i in penalized], penalized)
        return logits

    def _held_back(self, seq: Sequence) -> tuple[int, ...]:
        """The stop tokens min_tokens masks at this step (none once the output is long enough)."""
        p = seq.sampling_params
        if seq.num_output_tokens >= p.min_tokens:
            return ()
        eos = () if p.ignore_eos else self.eos_token_ids
        return tuple(sorted(set(p.stop_token_ids) | set(eos)))

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        """Repetition, frequency and presence penalties on `logits[rows]` (in place)."""
        vocab_size = logits.shape[1]
        seen, output_counts = self.history.counts(seqs, vocab_size)            # [P, vocab] bool, int32
        params = [seq.sampling_params for seq in seqs]
        values = torch.tensor([[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                               [p.presence_penalty for p in params]], dtype=torch.float32)
        values = values.to(logits.device, non_blocking=True)
        index = torch.tensor(rows).to(logits.device, non_blocking=True)
        x = logits.index_select(0, index)                                       # [P, vocab]
        repetition = values[0][:, None]
        penalized = torch.where(x > 0, x / repetition, x * repetition)
        x = torch.where(seen, penalized, x)
        x = x - values[1][:, None] * output_counts.float()
        x = x - values[2][:, None] * (output_counts > 0).float()
        logits.index_copy_(0, index, x)

    def _batch_params(self, seqs: list[Sequence], vocab_size: int) -> BatchParams:
        """What the sampler needs of the batch's sampling params, kept while the batch's params stay the same
        (consecutive decode steps of the same requests: one list comparison instead of a pass per property)."""
        params = [seq.sampling_params for seq in seqs]
        cached = self._batch
        if cached is None or cached.vocab_size != vocab_size or cached.params != params:
            cached = self._batch = BatchParams(params, vocab_size)
        return cached

    def _load_inputs(self, seqs: list[Sequence], batch: BatchParams) -> torch.Tensor:
        """Per-sequence sampling inputs as a [5, num_seqs] float64 device tensor."""
        seeds = [seq.sampling_seed for seq in seqs]
        if seeds != self._seeds:
            if None in seeds:
                unseeded = seqs[seeds.index(None)]
                raise ValueError(f"request {unseeded.request_id!r} has no sampling seed; Scheduler.add assigns one")
            self._seeds, self._mixed_seeds = seeds, mixed_seeds(seeds)
        steps = [seq.num_output_tokens for seq in seqs]
        n = len(seqs)
        staging = self._staging_np[:, :n]
        staging[:] = batch.rows
        staging[3] = random_bits_mixed(self._mixed_seeds, steps)  # < 2^52: exact in float64
        return self._inputs[:, :n].copy_(self._staging[:, :n], non_blocking=True)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], batch: BatchParams) -> torch.Tensor:
        """Temperature, min_p, top-k, top-p, then an inverse-CDF draw; [num_seqs] int64 token ids."""
        inputs = self._load_inputs(seqs, batch)
        use_min_p, filters = batch.use_min_p, batch.filters
        if all(filters) or not any(filters):
            return self._draw(logits, inputs, filters[0], use_min_p, bool(batch.unit_temperature.all()))
        # A row's draw must not depend on its neighbours: rows that filter walk the vocabulary sorted by
        # probability, the others in id order (the same random number picks another token), so the two
        # groups are drawn apart.
        picked = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        for needs_filter in (False, True):
            rows = [i for i, f in enumerate(filters) if f == needs_filter]
            index = torch.tensor(rows).to(logits.device, non_blocking=True)
            unit = bool(batch.unit_temperature[rows].all())
            group = self._draw(logits.index_select(0, index), inputs.index_select(1, index), needs_filter, use_min_p,
                               unit)
            picked.index_copy_(0, index, group)
        return picked

    @staticmethod
    def _draw(logits: torch.Tensor, inputs: torch.Tensor, needs_filter: bool, use_min_p: bool,
              unit_temperature: bool = False) -> torch.Tensor:
        """The draw of `_sample` for rows that all filter (top-k/top-p: sorted vocabulary) or none do.
        `unit_temperature`: every row's temperature is exactly 1.0 in float32, so the division is skipped
        (x / 1.0 == x for every float: the same probabilities, bit for bit, without a pass over the logits)."""
        scaled = logits if unit_temperature else logits / inputs[0].float()[:, None]
        probs = torch.softmax(scaled, dim=-1)                                # [num_seqs, vocab]
        if use_min_p:
            # min_p: drop tokens below min_p times the row's most likely one (rows with 0 keep all).
            min_p = inputs[4].float()
            probs.masked_fill_(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
        if needs_filter:
            return _draw_filtered(probs, inputs)
        return _inverse_cdf(probs, inputs[3])


def _target(total: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """floor(total * bits / 2^52) for int64 [rows] totals and random integers; < total where total > 0, so
    the first cdf entry above it is a token with positive weight. In two 26-bit halves (floor of floors is
    exact), each product below 2^63."""
    high, low = bits >> _HALF_BITS, bits & ((1 << _HALF_BITS) - 1)
    return (total * high + ((total * low) >> _HALF_BITS)) >> _HALF_BITS


def _draw_filtered(probs: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """top-k, top-p and the draw over the vocabulary sorted by probability: [num_seqs] int64 token ids.
    The full int64 cumsums stay here (the sort costs several times more than they do)."""
    # Stable sort: ties keep token-id order, so top-p cuts are deterministic.
    probs, order = probs.sort(dim=-1, descending=True, stable=True)
    # top-k keeps every token as likely as the k-th: tokens of equal logits (common in bf16) are
    # kept or dropped together, not told apart by their ids (vLLM, transformers).
    kth = probs.gather(1, inputs[2].long()[:, None] - 1)
    probs.masked_fill_(probs < kth, 0.0)
    # Exact fixed-point weights: scaling by a power of two, then truncation.
    weights = probs.mul_(_PROB_SCALE).long()  # [num_seqs, vocab]
    del probs
    cdf = weights.cumsum(dim=-1)
    # Nucleus: keep tokens whose preceding mass is below top_p of the (top-k) total;
    # exclusive < x  <=>  exclusive < ceil(x) for integers, so this stays exact.
    threshold = torch.ceil(inputs[1] * cdf[:, -1].double()).long()
    weights.masked_fill_(cdf - weights >= threshold[:, None], 0)
    picked = _search_dense(weights, inputs[3].long())
    return order.gather(1, picked[:, None]).squeeze(1)


def _search_dense(weights: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """The token drawn by `bits` [rows] int64 from `weights` [rows, vocab] int64: searchsorted over the
    whole int64 cdf, clamped to the vocabulary (only NaN logits could push it past the end)."""
    cdf = weights.cumsum(dim=-1)                                             # exact int64
    picked = torch.searchsorted(cdf, _target(cdf[:, -1], bits)[:, None], right=True)  # [rows, 1]
    return picked.squeeze(1).clamp_(max=weights.shape[1] - 1)


def _inverse_cdf(probs: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """The token of each row drawn by `bits` [rows] (float64 random integers) from `probs` [rows, vocab]
    (softmax output, maybe masked: each in [0, 1] or NaN): exactly `_search_dense` of the quantized weights
    (the old draw), by block sums. On CUDA two Triton kernels (sampler_kernels.py); elsewhere the same search
    in PyTorch; a CUDA device without triton keeps the full cumsum (a block search in PyTorch could not
    hand a NaN row to the dense search there without a host sync)."""
    if probs.is_cuda:
        from torpor.engine import sampler_kernels  # no triton import on CPU engines

        if sampler_kernels.available(probs):
            return sampler_kernels.inverse_cdf(probs, bits)
        return _search_dense(probs.mul_(_PROB_SCALE).long(), bits.long())
    if probs.shape[1] <= 4 * _SEARCH_BLOCK:  # a few blocks: the full cumsum costs less than ~30 small ops
        return _search_dense(probs.mul_(_PROB_SCALE).long(), bits.long())
    # The rows with a NaN probability, whose weights are negative (INT64_MIN): a float sum is NaN exactly
    # there (a pass over float32, cheaper on CPU than a min over the int64 weights).
    unsorted = probs.sum(dim=-1).isnan()
    return _search_blocks(probs.mul_(_PROB_SCALE).long(), bits.long(), unsorted=unsorted)


def _search_blocks(weights: torch.Tensor, bits: torch.Tensor, block: int | None = None,
                   unsorted: torch.Tensor | None = None) -> torch.Tensor:
    """`_search_dense(weights, bits)` without the [rows, vocab] cdf: the sums of `block` columns, the first
    block whose running total passes the target, a cumsum inside that block only. Exact for rows without a
    negative weight (the cdf is sorted: integer sums are exact in any order); rows with one (NaN logits;
    the CPU checks at no sync cost) take `_search_dense`, whose answer there is its binary search's.
    `unsorted` [rows] bool: rows that may hold a negative weight (default: those that do)."""
    vocab_size = weights.shape[1]
    block = min(block or _SEARCH_BLOCK, vocab_size)
    sums = _block_sums(weights, block)                                       # [rows, blocks]
    ends = sums.cumsum(dim=-1)                                               # the cdf at each block's end
    target = _target(ends[:, -1], bits)[:, None]                             # [rows, 1]
    # The first block whose end passes the target (a target at or past the total counts every block: the
    # last one then, whose every column counts too, giving a column >= vocab_size: searchsorted's end).
    first = (ends <= target).sum(dim=-1, keepdim=True).clamp_(max=sums.shape[1] - 1)  # [rows, 1]
    cols = first * block + torch.arange(block, device=weights.device)                # [rows, block]
    in_block = weights.gather(1, cols.clamp(max=vocab_size - 1)).masked_fill_(cols >= vocab_size, 0)
    cdf = in_block.cumsum_(dim=-1).add_(ends.gather(1, first) - sums.gather(1, first))  # + the cdf before it
    picked = (first.squeeze(1) * block + (cdf <= target).sum(dim=-1)).clamp_(max=vocab_size - 1)
    if unsorted is None:
        unsorted = weights.amin(dim=-1) < 0                                   # [rows]
    if unsorted.any():
        rows_index = unsorted.nonzero().squeeze(1)
        picked[rows_index] = _search_dense(weights[rows_index], bits[rows_index])
    return picked


def _block_sums(weights: torch.Tensor, block: int) -> torch.Tensor:
    """[rows, vocab] int64 -> the sums of each `block` columns [rows, ceil(vocab / block)] (exact)."""
    vocab_size = weights.shape[1]
    whole = vocab_size // block * block
    sums = weights[:, :whole].unflatten(1, (-1, block)).sum(dim=-1)
    if whole < vocab_size:
        sums = torch.cat([sums, weights[:, whole:].sum(dim=-1, keepdim=True)], dim=1)
    return sums


class TokenHistory:
    """The tokens so far (prompt + output) of the requests that use penalties, on the device.

    `rows` [max_num_seqs, max_model_len] int32 is allocated once; a request gets a row the first step
    it needs one and keeps it while it is sampled. Each step uploads only the tokens a row lacks (one
    per decode step; the whole sequence when a request first needs a row, or after it lost its row).
    A row is taken back, least recently used first, only from a request that is not in the current
    batch; at most max_num_seqs requests share a batch, so one is always free. The host bookkeeping
    says which request owns which row and how many of its tokens are written: a row is always read
    with its owner's length, so stale tokens past it are never counted."""

    def __init__(self, max_num_seqs: int, max_model_len: int, device: torch.device) -> None:
        self.max_model_len = max_model_len
        self.rows = torch.zeros(max_num_seqs, max_model_len, dtype=torch.int32, device=device)
        self._slot: dict[int, int] = {}                    # id(owner) -> row; owners are held, so ids stay unique
        self._owner: list[Sequence | None] = [None] * max_num_seqs
        self._written = [0] * max_num_seqs                 # tokens of the owner in its row
        self._last_used = [-1] * max_num_seqs              # step of last use (LRU)
        self._step = 0

    @staticmethod
    def state_bytes(max_num_seqs: int, max_model_len: int) -> int:
        return max_num_seqs * max_model_len * 4

    def counts(self, seqs: list[Sequence], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For each of `seqs`: which tokens occur in prompt or output ([P, vocab] bool) and how often
        each occurs in the output ([P, vocab] int32). Exact integers: the same whatever the batch."""
        if self.max_model_len == 0:
            raise ValueError("this Sampler keeps no token history (max_model_len=0): penalties are off")
        slots = self._sync(seqs)
        width = max(len(seq) for seq in seqs)
        meta = torch.tensor([slots, [len(s) for s in seqs], [s.num_prompt_tokens for s in seqs]])
        meta = meta.to(self.rows.device, non_blocking=True)
        tokens = self.rows[:, :width].index_select(0, meta[0]).long()           # [P, width]
        positions = torch.arange(width, device=self.rows.device)[None, :]
        in_sequence = positions < meta[1][:, None]                               # [P, width]
        in_output = in_sequence & (positions >= meta[2][:, None])
        zeros = torch.zeros(len(seqs), vocab_size, dtype=torch.int32, device=self.rows.device)
        seen = zeros.scatter_add(1, tokens, in_sequence.int()) > 0
        output_counts = zeros.scatter_add_(1, tokens, in_output.int())
        return seen, output_counts

    def _sync(self, seqs: list[Sequence]) -> list[int]:
        """The row of each of `seqs`, with every token of it written; one upload for all of them."""
        self._step += 1
        batch = {id(seq) for seq in seqs}
        slots, rows, positions, tokens = [], [], [], []
        for seq in seqs:
            if len(seq) > self.max_model_len:
                raise ValueError(f"request {seq.request_id!r} has {len(seq)} tokens, more than the token "
                                 f"history holds ({self.max_model_len})")
            slot = self._slot.get(id(seq))
            if slot is None:
                slot = self._claim(seq, batch)
            start = self._written[slot]
            rows += [slot] * (len(seq) - start)
            positions += range(start, len(seq))
            tokens += seq.token_ids[start:]
            self._written[slot], self._last_used[slot] = len(seq), self._step
            slots.append(slot)
        if tokens:
            upload = torch.tensor([rows, positions, tokens]).to(self.rows.device, non_blocking=True)
            self.rows.index_put_((upload[0], upload[1]), upload[2].int())
        return slots

    def reset(self) -> None:
        """Forget every row (for a caller that lost the rows' contents; sleep levels 1-2 offload them)."""
        self._slot.clear()
        self._owner = [None] * len(self._owner)
        self._written = [0] * len(self._written)

    def _claim(self, seq: Sequence, batch: set[int]) -> int:
        free = [i for i, owner in enumerate(self._owner) if owner is None or id(owner) not in batch]
        if not free:
            raise ValueError(f"more than {len(self._owner)} penalized requests in one batch")
        slot = min(free, key=lambda i: (self._owner[i] is not None, self._last_used[i]))
        old = self._owner[slot]
        if old is not None:
            del self._slot[id(old)]
        self._owner[slot], self._slot[id(seq)], self._written[slot] = seq, slot, 0
        return slot


def _logprob_values(logits: torch.Tensor, token_ids: torch.Tensor, max_top: int) -> list[torch.Tensor]:
    """log_softmax(logits) [rows, vocab] at each row's token ([rows] float32) and, with max_top > 0, its
    `max_top` largest values ([rows, max_top] float32, sorted) and their ids ([rows, max_top] int64)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)                   # [rows, vocab]
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)             # [rows]
    if not max_top:
        return [chosen]
    top_values, top_ids = logprobs.topk(max_top, dim=-1)
    return [chosen, top_values, top_ids]


def _to_host(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """int64 and float32 device tensors on the host in ONE copy (one synchronization instead of one per
    tensor): packed into an int64 tensor, the float32 ones by their bits (a float's bits, not a conversion
    on the device, so the host gets the same floats as `tolist()` gave, NaN payloads included)."""
    if any(t.dtype not in (torch.int64, torch.float32) for t in tensors):
        raise ValueError(f"only int64 and float32 tensors, got {[t.dtype for t in tensors]}")
    flat = [t.reshape(-1) if t.dtype == torch.int64 else t.reshape(-1).view(torch.int32).long() for t in tensors]
    packed = torch.cat(flat).cpu().numpy()
    arrays, start = [], 0
    for t in tensors:
        part = packed[start : start + t.numel()]
        start += t.numel()
        if t.dtype == torch.float32:
            part = part.astype(np.int32).view(np.float32)  # the low 32 bits: the float's own
        arrays.append(part.reshape(t.shape))
    return arrays


def _build_dicts(chosen_ids: list[int], values: list[np.ndarray], num_top: list[int]) -> list[TokenLogprobs]:
    """{chosen token: logprob, top tokens: logprobs} per row from `_logprob_values`' arrays on the host."""
    chosen_lp = values[0].tolist()
    if len(values) > 1:
        top_values, top_ids = values[1].tolist(), values[2].tolist()
    else:
        top_values = top_ids = [[] for _ in num_top]
    dicts = []
    for i, k in enumerate(num_top):
        d = {chosen_ids[i]: chosen_lp[i]}
        d.update(zip(top_ids[i][:k], top_values[i][:k], strict=True))
        dicts.append(d)
    return dicts


def _logprob_dicts(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """For each row: {actual token: logprob, top-k tokens: logprobs} from log_softmax(logits)."""
    host_ids, *values = _to_host([token_ids, *_logprob_values(logits, token_ids, max(num_top))])
    return _build_dicts(host_ids.tolist(), values, num_top)


def compute_prompt_logprobs(logits: torch.Tensor, prompt_token_ids: list[int],
                            num_top: int) -> list[TokenLogprobs | None]:
    """Prompt logprobs from the logits of positions 0..prompt_len-2 ([prompt_len - 1, vocab]):
    entry j+1 holds the logprob of prompt token j+1 plus the top `num_top`; entry 0 is None."""
    num_positions = len(prompt_token_ids) - 1
    if logits.dim() != 2 or logits.shape[0] != num_positions:
        raise ValueError(f"prompt of {len(prompt_token_ids)} tokens needs logits "
                         f"[{num_positions}, vocab], got {list(logits.shape)}")
    next_ids = torch.tensor(prompt_token_ids[1:], dtype=torch.long).to(logits.device, non_blocking=True)
    result: list[TokenLogprobs | None] = [None]
    for start in range(0, num_positions, _PROMPT_CHUNK):
        end = min(start + _PROMPT_CHUNK, num_positions)
        result += _logprob_dicts(logits[start:end], next_ids[start:end], [num_top] * (end - start))
    return result
