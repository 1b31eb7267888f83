"""The sampler's Triton kernels (sampler_kernels.py), run on CPU tensors by Triton's interpreter, against the
full-cumsum draw they replace (`_search_dense`, the old `_draw`'s search): the same token, exactly, for real
softmax rows, rows with many zero weights, targets exactly on the cdf, and NaN weights anywhere."""

import os

import pytest
import torch

if torch.cuda.is_available():
    # Interpreter mode is process-wide and would turn the compiled kernels of tests/gpu into interpreted ones.
    pytest.skip("the interpreter tests run on machines without CUDA; tests/gpu covers it", allow_module_level=True)
# Triton's interpreter runs kernels on CPU tensors; the variable is read when triton is first imported.
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 7):
    # 3.6's interpreter loads a scalar as a 1-element array, which the kernel's data-dependent loop rejects
    pytest.skip(f"the Triton interpreter tests need triton >= 3.7, found {triton.__version__}", allow_module_level=True)
if not isinstance(triton.language.cdiv, InterpretedFunction):
    pytest.skip(
        "triton was imported before TRITON_INTERPRET=1 could be set: run this file in its own pytest process",
        allow_module_level=True,
    )

from sampler_checks import boundary_bits  # noqa: E402

from torpor.engine import sampler_kernels  # noqa: E402
from torpor.engine.sampler import _PROB_SCALE, _block_sums, _search_dense  # noqa: E402


def quantized(probs: torch.Tensor) -> torch.Tensor:
    """The old draw's weights: (probs * 2^36).long()."""
    return (probs * _PROB_SCALE).long()


def check(probs: torch.Tensor, bits: torch.Tensor, block: int) -> None:
    """Kernel tokens == the full cumsum's searchsorted; kernel block sums == PyTorch's exact sums."""
    weights = quantized(probs)
    expected = _search_dense(weights, bits)
    tokens = sampler_kernels.inverse_cdf(probs, bits.double(), block)
    assert tokens.dtype == torch.int64 and tokens.tolist() == expected.tolist()
    sums, negative = sampler_kernels.block_sums(probs, block)
    assert torch.equal(sums, _block_sums(weights, block))  # modulo 2^64 where NaN weights are summed
    in_blocks = torch.nn.functional.pad(weights, (0, sums.shape[1] * block - weights.shape[1]))
    assert negative.tolist() == (in_blocks.view(len(probs), -1, block).amin(-1) < 0).int().tolist()


@pytest.mark.parametrize(("vocab_size", "block"), [(1000, 64), (1024, 64), (17, 16), (300, 256), (5, 16)])
def test_softmax_rows(vocab_size, block):
    """Rows as the sampler makes them: flat, ordinary, peaked (most weights 0), with -inf logits, bf16 ties."""
    gen = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(6, vocab_size, generator=gen) * torch.tensor([1e-3, 1.0, 4.0, 40.0, 400.0, 2.0])[:, None]
    logits[5, torch.rand(vocab_size, generator=gen) < 0.7] = -torch.inf
    logits[5, 0] = 0.0
    logits[1] = logits[1].bfloat16().float()
    probs = torch.softmax(logits, -1)
    check(probs, torch.randint(0, 2**52, (6,), generator=gen), block)
    check(probs, boundary_bits(quantized(probs), vocab_size), block)


@pytest.mark.parametrize("vocab_size", [1001, 1000])
def test_nan_weights_follow_torchs_binary_search(vocab_size):
    """NaN probabilities (NaN or +inf logits, rows of -inf) quantize to INT64_MIN: the cdf is no longer
    sorted and torch's answer is its binary search's; the kernel probes the same columns. Whole NaN rows
    (what softmax makes of them) and scattered NaN entries, odd and even vocabularies."""
    gen = torch.Generator().manual_seed(vocab_size)
    probs = torch.rand(7, vocab_size, generator=gen)
    probs /= probs.sum(-1, keepdim=True)
    for row, density in enumerate([0.0, 1.0, 0.5, 0.01, 1.0, 0.003, 0.9]):
        probs[row, torch.rand(vocab_size, generator=gen) < density] = torch.nan
    probs[4] = torch.softmax(torch.full((vocab_size,), -torch.inf), -1)  # all -inf: NaN everywhere
    for seed in range(2):
        check(probs, torch.randint(0, 2**52, (7,), generator=torch.Generator().manual_seed(seed)), 64)


def test_strided_rows_and_no_rows():
    """A row stride wider than the vocabulary (a slice of a wider buffer); an empty batch."""
    gen = torch.Generator().manual_seed(1)
    probs = torch.zeros(3, 160)[:, :100]
    probs.copy_(torch.softmax(torch.randn(3, 100, generator=gen) * 3, -1))
    assert probs.stride(0) == 160
    check(probs, torch.randint(0, 2**52, (3,), generator=gen), 16)
    assert sampler_kernels.inverse_cdf(torch.empty(0, 100), torch.empty(0, dtype=torch.float64)).shape == (0,)


def test_bad_arguments():
    probs = torch.full((2, 64), 1 / 64)
    bits = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="float32"):
        sampler_kernels.inverse_cdf(probs.double(), bits)
    with pytest.raises(ValueError, match="contiguous"):
        sampler_kernels.inverse_cdf(torch.full((64, 2), 1 / 64).T, bits)
    with pytest.raises(ValueError, match="power of two"):
        sampler_kernels.inverse_cdf(probs, bits, block=48)
    with pytest.raises(ValueError, match="bits"):
        sampler_kernels.inverse_cdf(probs, bits.long())
    assert not sampler_kernels.available(probs)  # CPU tensors: the sampler searches in PyTorch
