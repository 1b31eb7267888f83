"""Random sampler batches and a bit-level comparison of sampler outputs, shared by the CPU and GPU exactness
tests of the sampler (tests/cpu/test_sampler_exact.py, tests/gpu/test_sampler_exact.py) and
scripts/bench_sampler.py: the current `Sampler` against `references.ReferenceSampler` (the old draw)."""

from __future__ import annotations

import random
import struct

import torch

from torpor.engine.sampler import SamplerOutput
from torpor.engine.sampling_params import SamplingParams
from torpor.engine.sequence import Sequence

EOS = (1, 2)  # the eos ids min_tokens holds back
# Exactly 1.0, 1.0 once rounded to float32 (the draw's division is then skipped too), others
TEMPERATURES = [1.0, 1.0, 1.0, 1.0 + 1e-9, 0.0, 0.7, 1.3, 2.5, 1e-4]


def float_bits(x: float) -> bytes:
    """The bits of a Python float (NaN payloads and -0.0 included)."""
    return struct.pack("<d", x)


def assert_same_outputs(new: SamplerOutput, old: SamplerOutput, context: str = "") -> None:
    """Token ids equal, logprob dicts equal key by key and in order, each float bit for bit."""
    assert new.token_ids == old.token_ids, f"{context}: token ids differ"
    for row, (a, b) in enumerate(zip(new.logprobs, old.logprobs, strict=True)):
        if a is None or b is None:
            assert a is b, f"{context}: row {row} logprobs {a!r} vs {b!r}"
            continue
        assert [(k, float_bits(v)) for k, v in a.items()] == [(k, float_bits(v)) for k, v in b.items()], (
            f"{context}: row {row} logprobs {a} vs {b}"
        )


def random_params(rng: random.Random, row: int, vocab_size: int, options: bool) -> SamplingParams:
    """One row's sampling params: GRPO-like mostly (seeded, temperature 1, no filters), with greedy rows,
    other temperatures, logprobs of 0..5 and, with `options`, top-k/top-p/min_p and logits processing."""
    kwargs: dict = dict(seed=rng.randrange(2**64) - 2**63 if rng.random() < 0.1 else rng.randrange(10**6) + row,
                        temperature=rng.choice(TEMPERATURES), logprobs=rng.choice([None, None, 0, 1, 5]))
    if options:
        kwargs |= dict(top_k=rng.choice([-1, -1, -1, 1, 3, 50]), top_p=rng.choice([1.0, 1.0, 0.95, 0.5, 1e-3]),
                       min_p=rng.choice([0.0, 0.0, 0.0, 0.05, 1.0]))
        if rng.random() < 0.2:
            kwargs["logit_bias"] = {rng.randrange(vocab_size): rng.uniform(-100, 100) for _ in range(3)}
        if rng.random() < 0.2:
            kwargs |= dict(min_tokens=4, max_tokens=16)  # eos masked to -inf at these first steps
        if rng.random() < 0.1:
            kwargs |= dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.5)
    return SamplingParams(**kwargs)


def random_logits(rng: random.Random, num_seqs: int, vocab_size: int, device: torch.device | str,
                  nan_rows: bool = True) -> torch.Tensor:
    """[num_seqs, vocab] float32 logits of mixed shapes: flat, ordinary, very peaked rows, bf16-rounded rows
    (ties), rows with -inf entries, a row of equal logits, and (`nan_rows`) rare NaN / +inf / all -inf rows."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    scales = torch.tensor([rng.choice([1e-3, 0.5, 2.0, 4.0, 30.0, 300.0]) for _ in range(num_seqs)])
    logits = torch.randn(num_seqs, vocab_size, generator=gen) * scales[:, None]
    for row in range(num_seqs):
        kind = rng.random()
        if kind < 0.15:
            logits[row] = logits[row].bfloat16().float()  # many exact ties
        elif kind < 0.25:
            logits[row, torch.rand(vocab_size, generator=gen) < rng.random()] = -torch.inf
            logits[row, rng.randrange(vocab_size)] = 0.0  # at least one finite logit
        elif kind < 0.28:
            logits[row] = 1.5  # a uniform row: every weight equal
        elif nan_rows and kind < 0.30:
            logits[row, rng.randrange(vocab_size)] = rng.choice([torch.nan, torch.inf])
        elif nan_rows and kind < 0.31:
            logits[row] = -torch.inf
    return logits.to(device)


def twin_sequences(params: list[SamplingParams]) -> tuple[list[Sequence], list[Sequence]]:
    """Two identical lists of fresh sequences with these params (one per sampler: sampling appends tokens)."""
    def make() -> list[Sequence]:
        return [Sequence(f"r{i}", [3, 4, 5], p) for i, p in enumerate(params)]

    return make(), make()


def boundary_bits(weights: torch.Tensor, seed: int) -> torch.Tensor:
    """Random integers in [0, 2^52) for the rows of `weights` [rows, vocab] int64 that put the draw's target
    exactly ON the cdf at a chosen column (where `<=` and `<` part, and where runs of zero weights keep the
    cdf flat): bits = ceil(cdf[j] * 2^52 / total) gives floor(total * bits / 2^52) = cdf[j]. Columns are
    random, at block ends and at the row's ends; rows with a negative weight or no positive total get random bits."""
    rng = random.Random(seed)
    vocab_size = weights.shape[1]
    bits = []
    negative = (weights.amin(-1) < 0).tolist()
    for row, cdf in enumerate(weights.cumsum(-1).tolist()):
        total = cdf[-1]
        if total <= 0 or negative[row] or row % 5 == 4:
            bits.append(rng.choice([0, 2**52 - 1, rng.randrange(2**52)]))
            continue
        j = rng.choice([rng.randrange(vocab_size), 0, vocab_size - 1] + [b - 1 for b in (16, 64, 100, 1024)
                                                                           if b <= vocab_size])
        bits.append(min(-(-cdf[j] * 2**52 // total), 2**52 - 1))
    return torch.tensor(bits, dtype=torch.int64)


def run_both(params: list[SamplingParams], logits_for_step, num_steps: int, context: str,
             device: torch.device | str = "cpu", max_model_len: int = 64) -> None:
    """The same batch through the current and the reference sampler on `device` for `num_steps` steps (each
    side's tokens appended to its own sequences), asserting identical outputs at every step."""
    from references import ReferenceSampler

    from torpor.engine.sampler import Sampler

    new_seqs, old_seqs = twin_sequences(params)
    new, old = (cls(len(params), device, max_model_len, EOS) for cls in (Sampler, ReferenceSampler))
    for step in range(num_steps):
        logits = logits_for_step(step)
        a, b = new(logits, new_seqs), old(logits.clone(), old_seqs)
        assert_same_outputs(a, b, f"{context} step {step}")
        for seqs, out in ((new_seqs, a), (old_seqs, b)):
            for seq, token in zip(seqs, out.token_ids, strict=True):
                seq.append_token(token)
