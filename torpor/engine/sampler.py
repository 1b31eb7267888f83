"""Token sampling and logprobs, vectorized over the batch.

Reproducibility. A sampled token is chosen by inverse-CDF sampling with ONE random number per
sequence, derived on the host from (sampling_seed, output step) by a counter-based hash
(splitmix64). So a seeded request draws the same numbers whatever shares its batch, after
preemption and recompute, and across sleep/wake; no generator state exists to save or restore.
The CDF is an exact int64 prefix sum of the probabilities quantized to multiples of 2^-36
(a float cumsum is non-deterministic on CUDA), so the pick is bit-reproducible on each device.
Tokens below 2^-36 probability are never drawn; that truncation moves < vocab * 2^-36 of mass.

CUDA graphs. The sampler runs eagerly on the graph's logits output: whether a batch needs the
sort for top-k/top-p is a host decision per step (capturing each combination would multiply
graph memory), and it is a handful of kernels next to the model's hundreds. It makes no host
sync before the final copy of the token ids, and its per-step inputs live in one persistent
buffer (allocate the Sampler inside the runtime memory tag), so capturing it later stays open.

Logprobs are log_softmax of the *unmodified* logits (before temperature, top-k, top-p): the
model's own distribution, comparable across sampling settings (vLLM's default "raw" logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torpor.engine.outputs import TokenLogprobs
from torpor.engine.sequence import Sequence

_MASK64 = (1 << 64) - 1
_RANDOM_BITS = 26          # the uniform number per sequence: an int in [0, 2^26)
_PROB_SCALE = 2.0 ** 36    # probability quantum; total * 2^26 stays below 2^63 (no overflow)
_PROMPT_CHUNK = 512        # prompt positions per log_softmax, to bound temporary memory


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def random_bits(seed: int, step: int) -> int:
    """The random integer in [0, 2^26) for output token `step` of a request seeded `seed`."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ step) >> (64 - _RANDOM_BITS)


@dataclass
class SamplerOutput:
    token_ids: list[int]                        # one per sequence
    logprobs: list[TokenLogprobs | None]        # None where params.logprobs is None


class Sampler:
    """Picks the next token of every sequence from its float32 logits."""

    def __init__(self, max_num_seqs: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        # Rows: temperature, top_p, top_k, random bits (all exact in float64). One host->device
        # copy per step; the host side is pinned on CUDA so the copy is asynchronous (reusing it
        # next step is safe: each call ends by syncing on the token ids).
        self._inputs = torch.zeros(4, max_num_seqs, dtype=torch.float64, device=self.device)
        self._staging = torch.zeros(4, max_num_seqs, dtype=torch.float64,
                                    pin_memory=self.device.type == "cuda")

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """logits: [num_seqs, vocab] float32, row i for seqs[i]."""
        num_seqs = len(seqs)
        if logits.dim() != 2 or logits.shape[0] != num_seqs or logits.dtype != torch.float32:
            raise ValueError(f"logits must be float32 [{num_seqs}, vocab], got "
                             f"{logits.dtype} {list(logits.shape)}")
        if num_seqs > self._inputs.shape[1]:
            raise ValueError(f"{num_seqs} sequences exceed max_num_seqs ({self._inputs.shape[1]})")
        params = [seq.sampling_params for seq in seqs]
        token_ids = logits.argmax(dim=-1)                                   # [num_seqs]
        if not all(p.is_greedy for p in params):
            sampled = self._sample(logits, seqs)
            is_greedy = torch.tensor([p.is_greedy for p in params]).to(logits.device, non_blocking=True)
            token_ids = torch.where(is_greedy, token_ids, sampled)
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs: list[TokenLogprobs | None] = [None] * num_seqs
        if logprob_rows:
            num_top = [params[i].logprobs for i in logprob_rows]
            if len(logprob_rows) == num_seqs:
                dicts = _logprob_dicts(logits, token_ids, num_top)
            else:
                rows = torch.tensor(logprob_rows).to(logits.device, non_blocking=True)
                dicts = _logprob_dicts(logits.index_select(0, rows), token_ids.index_select(0, rows), num_top)
            for i, d in zip(logprob_rows, dicts, strict=True):
                logprobs[i] = d
        return SamplerOutput(token_ids.tolist(), logprobs)

    def _load_inputs(self, seqs: list[Sequence], vocab_size: int) -> torch.Tensor:
        """Per-sequence sampling inputs as a [4, num_seqs] float64 device tensor."""
        rows = [[], [], [], []]
        for seq in seqs:
            p = seq.sampling_params
            if seq.sampling_seed is None:
                raise ValueError(f"request {seq.request_id!r} has no sampling seed; "
                                 "Scheduler.add assigns one")
            rows[0].append(1.0 if p.is_greedy else p.temperature)   # greedy rows are discarded
            rows[1].append(p.top_p)
            rows[2].append(vocab_size if p.top_k == -1 else min(p.top_k, vocab_size))
            rows[3].append(random_bits(seq.sampling_seed, seq.num_output_tokens))
        n = len(seqs)
        self._staging[:, :n].copy_(torch.tensor(rows, dtype=torch.float64))
        return self._inputs[:, :n].copy_(self._staging[:, :n], non_blocking=True)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Temperature, top-k, top-p, then an inverse-CDF draw; [num_seqs] int64 token ids."""
        vocab_size = logits.shape[1]
        inputs = self._load_inputs(seqs, vocab_size)
        temperature = inputs[0].float()
        probs = torch.softmax(logits / temperature[:, None], dim=-1)       # [num_seqs, vocab]
        needs_filter = any(seq.sampling_params.needs_filter for seq in seqs)
        if needs_filter:
            # Stable sort: ties keep token-id order, so top-k cuts are deterministic.
            probs, order = probs.sort(dim=-1, descending=True, stable=True)
        # Exact fixed-point weights: scaling by a power of two, then truncation.
        weights = probs.mul_(_PROB_SCALE).long()  # [num_seqs, vocab]
        del probs
        if needs_filter:
            top_k, top_p = inputs[2].long(), inputs[1]
            ranks = torch.arange(vocab_size, device=logits.device)
            weights.masked_fill_(ranks[None, :] >= top_k[:, None], 0)
            cdf = weights.cumsum(dim=-1)
            # Nucleus: keep tokens whose preceding mass is below top_p of the (top-k) total;
            # exclusive < x  <=>  exclusive < ceil(x) for integers, so this stays exact.
            threshold = torch.ceil(top_p * cdf[:, -1].double()).long()
            weights.masked_fill_(cdf - weights >= threshold[:, None], 0)
        cdf = weights.cumsum(dim=-1)                                        # exact int64
        # target < total, so the first cdf entry above it is a token with positive weight.
        target = (cdf[:, -1] * inputs[3].long()) >> _RANDOM_BITS             # [num_seqs]
        picked = torch.searchsorted(cdf, target[:, None], right=True)       # [num_seqs, 1]
        picked.clamp_(max=vocab_size - 1)  # only NaN logits could push it past the end
        if needs_filter:
            picked = order.gather(1, picked)
        return picked.squeeze(1)


def _logprob_dicts(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """For each row: {actual token: logprob, top-k tokens: logprobs} from log_softmax(logits)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)                   # [rows, vocab]
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)             # [rows]
    max_top = max(num_top)
    top_ids_host: list[list[int]] = [[] for _ in num_top]
    top_values_host: list[list[float]] = [[] for _ in num_top]
    if max_top:
        top_values, top_ids = logprobs.topk(max_top, dim=-1)  # [rows, max_top], sorted
        top_ids_host, top_values_host = top_ids.tolist(), top_values.tolist()
    chosen_ids, chosen_lp = token_ids.tolist(), chosen.tolist()
    dicts = []
    for i, k in enumerate(num_top):
        d = {chosen_ids[i]: chosen_lp[i]}
        d.update(zip(top_ids_host[i][:k], top_values_host[i][:k], strict=True))
        dicts.append(d)
    return dicts


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
