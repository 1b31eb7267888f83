"""The sampler on CUDA (the Triton block-sum draw, one-copy logprobs) against the old implementation
(references.ReferenceSampler: the full int64 cumsum) on the same device: bit-identical tokens and logprobs for
random batches, the GRPO shape at Qwen3's vocabulary, and the kernels alone on NaN rows and targets placed
exactly on the cdf."""

import functools
import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytestmark = pytest.mark.gpu
triton = pytest.importorskip("triton")

import sampler_checks  # noqa: E402
from sampler_checks import (  # noqa: E402
    boundary_bits,
    random_logits,
    random_params,
)
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from torpor.engine import sampler_kernels  # noqa: E402
from torpor.engine.sampler import _PROB_SCALE, _search_dense  # noqa: E402
from torpor.engine.sampling_params import SamplingParams  # noqa: E402

if not sampler_kernels._load_triton():
    pytest.skip("triton cannot be imported", allow_module_level=True)
if isinstance(sampler_kernels._draw_kernel, InterpretedFunction):
    pytest.skip(
        "TRITON_INTERPRET is set in this process (the CPU interpreter tests set it): "
        "run tests/gpu in its own pytest process",
        allow_module_level=True,
    )

DEVICE = torch.device("cuda")
QWEN3_VOCAB = 151936


run_both = functools.partial(sampler_checks.run_both, device=DEVICE)  # the current and the old sampler, on CUDA


def test_the_kernels_draw_on_cuda():
    assert sampler_kernels.available(torch.empty(1, 8, device=DEVICE))


@pytest.mark.parametrize("options", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_random_batches_match_the_reference(seed, options):
    """Every kind of row (greedy among sampled, temperatures, seeds, logprobs; with options the filters and
    logits processing) and logits (ties, -inf, flat, peaked, NaN) over vocabularies that are and are not
    multiples of the block."""
    rng = random.Random(100 * seed + options)
    vocab_size = rng.choice([QWEN3_VOCAB, QWEN3_VOCAB - 1, 2048 * 3, 2048 * 3 + 1, 1000, 37])
    num_seqs = rng.choice([1, 3, 64, 256, 512])
    params = [random_params(rng, row, vocab_size, options) for row in range(num_seqs)]
    run_both(params, lambda step: random_logits(rng, num_seqs, vocab_size, DEVICE), 3, f"seed {seed}")


@pytest.mark.parametrize(("temperature", "logprobs"), [(1.0, None), (1.0, 0), (1.0, 1), (0.0, None), (0.0, 1),
                                                       (0.7, 1)])
def test_grpo_shape_matches_the_reference(temperature, logprobs):
    """512 sequences at Qwen3's vocabulary, seeded, no filters: the RL-rollout step."""
    params = [SamplingParams(seed=s, temperature=temperature, logprobs=logprobs, max_tokens=64) for s in range(512)]
    gen = torch.Generator(DEVICE).manual_seed(0)
    run_both(params, lambda step: torch.randn(512, QWEN3_VOCAB, device=DEVICE, generator=gen) * 4, 3, "grpo")


@pytest.mark.parametrize("vocab_size", [QWEN3_VOCAB, QWEN3_VOCAB - 1])
@pytest.mark.parametrize("block", [1024, 2048, 4096])
def test_kernels_equal_the_full_cumsum(vocab_size, block):
    """The Triton draw against searchsorted over the full int64 cdf on the same probabilities: softmax rows
    of every shape, targets exactly on the cdf (where `<=` and `<` part), NaN weights (INT64_MIN on CUDA
    too: torch's binary search over the unsorted cdf, reproduced probe by probe)."""
    gen = torch.Generator(DEVICE).manual_seed(vocab_size + block)
    scales = torch.tensor([1e-3, 1.0, 4.0, 40.0, 400.0] * 12, device=DEVICE)[:, None]
    logits = torch.randn(60, vocab_size, device=DEVICE, generator=gen) * scales
    logits[5] = logits[5].bfloat16().float()
    logits[6, ::3] = -torch.inf
    logits[7, 11] = torch.nan
    logits[8, 0] = torch.inf
    logits[9] = -torch.inf
    probs = torch.softmax(logits, -1)
    probs[10, torch.rand(vocab_size, device=DEVICE, generator=gen) < 0.3] = torch.nan  # NaN here and there
    weights = (probs * _PROB_SCALE).long()
    assert (weights[7:11].amin(-1) < 0).all()  # NaN -> INT64_MIN, as the kernel assumes
    for bits in (torch.randint(0, 2**52, (60,), device=DEVICE, generator=gen),
                 boundary_bits(weights, block).to(DEVICE)):
        expected = _search_dense(weights, bits)
        tokens = sampler_kernels.inverse_cdf(probs, bits.double(), block)
        assert torch.equal(tokens, expected)
