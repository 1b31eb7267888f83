"""The sampler's block-sum draw and one-copy logprobs against the old implementation (references.py), bit
for bit: tokens, logprob values and their order, over random batches of every kind of row and logits."""

import random

import numpy as np
import pytest
import torch
from references import logprob_dicts_reference
from sampler_checks import (
    boundary_bits,
    float_bits,
    random_logits,
    random_params,
    run_both,
)

from torpor.engine import sampler as sampler_module
from torpor.engine.sampler import (
    BatchParams,
    _logprob_dicts,
    _search_blocks,
    _search_dense,
    _to_host,
    compute_prompt_logprobs,
)
from torpor.engine.sampling_params import SamplingParams


@pytest.mark.parametrize("block", [16, 100, 256])
@pytest.mark.parametrize("options", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_random_batches_match_the_reference(monkeypatch, seed, options, block):
    """Batches of 1..384 rows over vocabularies that are not multiples of the block (and one that is):
    greedy rows among sampled ones, temperatures of exactly 1 and others, seeds, logprobs; with options
    top-k/top-p/min_p, logit_bias, min_tokens (-inf logits) and penalties; ties, flat/peaked/NaN rows."""
    monkeypatch.setattr(sampler_module, "_SEARCH_BLOCK", block)
    rng = random.Random(1000 * seed + options)
    vocab_size = rng.choice([block * 5, block * 5 + 1, 4099, 4096, 37])  # above 4 blocks: the block search
    num_seqs = rng.choice([1, 2, 7, 64, 384])
    params = [random_params(rng, row, vocab_size, options) for row in range(num_seqs)]
    run_both(params, lambda step: random_logits(rng, num_seqs, vocab_size, "cpu"), 3, f"seed {seed}")


@pytest.mark.parametrize("temperature", [1.0, 0.0, 0.8])
@pytest.mark.parametrize("logprobs", [None, 0, 1])
def test_grpo_batches_match_the_reference(temperature, logprobs):
    """The workload that matters: every row seeded at one temperature, no filters, logprobs 0/1 or none."""
    params = [SamplingParams(seed=s, temperature=temperature, logprobs=logprobs, max_tokens=64) for s in range(96)]
    rng = random.Random(7)
    run_both(params, lambda step: random_logits(rng, 96, 2500, "cpu", nan_rows=False), 4, "grpo")  # 10 blocks


def test_blocks_equal_the_dense_search_for_any_weights():
    """`_search_blocks` against the full cumsum's searchsorted over weights of every kind: sorted cdfs,
    zero rows, NaN weights (INT64_MIN: unsorted cdfs, handed to the dense search) at any density."""
    gen = torch.Generator().manual_seed(0)
    for vocab_size in (1, 2, 15, 16, 17, 1000, 1001):
        probs = torch.softmax(torch.randn(24, vocab_size, generator=gen) * 30, -1)  # many zero weights
        probs[:2] = torch.rand(2, vocab_size, generator=gen)
        probs[:2] /= probs[:2].sum(-1, keepdim=True)
        probs[3] = 0.0
        probs[4, : vocab_size // 2] = 0.0
        for row, density in zip(range(5, 24, 3), (1.0, 0.5, 0.01, 1.0, 0.1, 0.9, 0.3), strict=True):
            probs[row, torch.rand(vocab_size, generator=gen) < density] = torch.nan
        weights = (probs * 2.0**36).long()
        for bits in (torch.randint(0, 2**52, (24,), generator=gen), boundary_bits(weights, vocab_size)):
            bits[:2] = torch.tensor([0, 2**52 - 1])
            expected = _search_dense(weights, bits)
            for block in (1, 3, 16, 64, 100, 4096):
                assert torch.equal(_search_blocks(weights, bits, block), expected), (vocab_size, block)


def test_unit_temperature_is_exactly_one_in_float32():
    """The division is skipped only for temperatures that are 1.0 once rounded to float32 (x / 1.0 == x);
    greedy rows count as 1.0 (their sampled token is discarded)."""
    temperatures = [1.0, 1.0 + 1e-9, 0.0, 1.0 + 1e-7, 0.9999999, 0.5]
    batch = BatchParams([SamplingParams(temperature=t) for t in temperatures], vocab_size=8)
    assert batch.unit_temperature.tolist() == [True, True, True, False, False, False]
    logits = torch.randn(4, 1000) * 5
    logits[0, :10] = torch.tensor([-torch.inf, torch.inf, torch.nan, -0.0, 0.0, 1e-45, -1e-45, 3e38, -3e38, 1.0])
    assert torch.equal(torch.softmax(logits / torch.ones(4)[:, None], -1).view(torch.int32),
                       torch.softmax(logits, -1).view(torch.int32))


def test_logprobs_match_the_reference():
    """`_logprob_dicts` (one host copy) against the old one (four copies): chosen and top ids, their order
    among ties, every float's bits, -inf and NaN logprobs."""
    rng = random.Random(3)
    for num_top in ([0], [1], [5, 0, 20, 1], [2] * 9):
        logits = random_logits(rng, len(num_top), 300, "cpu")
        token_ids = torch.tensor([rng.randrange(300) for _ in num_top])
        new, old = _logprob_dicts(logits, token_ids, num_top), logprob_dicts_reference(logits, token_ids, num_top)
        assert [[(k, float_bits(v)) for k, v in d.items()] for d in new] == \
               [[(k, float_bits(v)) for k, v in d.items()] for d in old]


def test_prompt_logprobs_match_the_reference():
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 50, (1100,), generator=gen).tolist()
    logits = torch.randn(1099, 50, generator=gen).bfloat16().float()  # ties among the top
    new = compute_prompt_logprobs(logits, prompt, num_top=3)
    next_ids = torch.tensor(prompt[1:])
    old = [None]
    for start in range(0, 1099, 512):
        chunk = next_ids[start : start + 512]
        old += logprob_dicts_reference(logits[start : start + 512], chunk, [3] * len(chunk))
    assert [None if d is None else [(k, float_bits(v)) for k, v in d.items()] for d in new] == \
           [None if d is None else [(k, float_bits(v)) for k, v in d.items()] for d in old]


def test_to_host_keeps_every_bit():
    """The one-copy transfer gives what `tolist()` gave, float bits included (NaN payloads, -0.0, subnormals)."""
    bits = torch.tensor([0x7FC00001, 0xFFC00000, 0x80000000, 0x00000001, 0x7F800000, 0xFF800000, 0x3F800000],
                        dtype=torch.int64).to(torch.int32)
    floats = torch.cat([bits.view(torch.float32), torch.randn(5)]).view(3, 4)
    ints = torch.tensor([[0, -1, 2**62], [151935, 7, -(2**63)]])
    host_ints, host_floats, empty = _to_host([ints, floats, torch.empty(0, 3)])
    assert host_ints.tolist() == ints.tolist() and empty.shape == (0, 3)
    assert host_floats.dtype == np.float32
    assert [float_bits(x) for x in host_floats.flatten().tolist()] == [float_bits(x) for x in floats.flatten().tolist()]
    with pytest.raises(ValueError, match="int64 and float32"):
        _to_host([torch.zeros(2, dtype=torch.int32)])
