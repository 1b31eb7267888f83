"""The one-node collectives of tensor_exchange.py (all-reduce, gather, broadcast), run by Triton's interpreter
in two real processes that share a host buffer the way GPU ranks share a symmetric device buffer: the
kernels' flag protocol (epochs, double buffering, waits on the peer) and the chunking are the ones the GPU runs.
"""

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("the interpreter tests run on machines without CUDA; tests/gpu covers it", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 7):
    pytest.skip(f"the Triton interpreter tests need triton >= 3.7, found {triton.__version__}", allow_module_level=True)
if not isinstance(triton.language.cdiv, InterpretedFunction):
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set: run this file in its own pytest process",
                allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402

SLOT_BYTES = 256 << 10  # small slots: the large cases go through in several chunks


class SharedHostBuffer:
    """A SymmetricBuffer over one shared host tensor (both processes map the same pages)."""

    def __init__(self, shared: torch.Tensor, rank: int, size: int) -> None:
        self.shared, self.rank, self.size, self.slot_bytes = shared, rank, size, SLOT_BYTES

    def view(self, dtype: torch.dtype) -> torch.Tensor:
        return self.shared.view(dtype)


def _cases(rank: int):
    """(name, op, input) in call order, the same on both ranks; inputs differ by rank."""
    g = torch.Generator().manual_seed(100 + rank)
    for numel in (5, 1000, 40_000, 3000):  # 40k fp32 = 160 KB: two chunks of the 96 KiB data areas
        yield "sum", torch.randn(numel, generator=g)
    yield "sum", torch.randn(3, 777, generator=g).to(torch.bfloat16)
    yield "gather", torch.randn(2, 15_000, generator=g)
    yield "broadcast", torch.randn(30_000, generator=g)


def _rank_main(rank: int, shared: torch.Tensor, results) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    from torpor.engine.tensor_exchange import TensorExchange

    exchange = TensorExchange(SharedHostBuffer(shared, rank, 2))
    out = []
    for name, x in _cases(rank):
        if name == "sum":
            out.append(exchange.all_reduce(x.clone()))
        elif name == "gather":
            out.append(exchange.gather_last_dim(x))
        else:
            out.append(exchange.broadcast(x.clone()))
    exchange.check()
    results[rank] = out


def test_two_ranks_reduce_gather_and_broadcast_exactly():
    shared = torch.zeros(2 * SLOT_BYTES, dtype=torch.uint8).share_memory_()
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    processes = [ctx.Process(target=_rank_main, args=(r, shared, results)) for r in range(2)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(300)
        assert p.exitcode == 0
    inputs = [list(_cases(0)), list(_cases(1))]
    for i, ((name, a), (_, b)) in enumerate(zip(*inputs, strict=True)):
        if name == "sum":
            expected = (a.float() + b.float()).to(a.dtype)
        elif name == "gather":
            expected = torch.cat([a, b], dim=-1)
        else:
            expected = a
        assert torch.equal(results[0][i], results[1][i]), (name, i)  # every rank holds the same bits
        if expected.dtype == torch.bfloat16:  # the interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest
            torch.testing.assert_close(results[0][i].float(), expected.float(), rtol=2**-7, atol=0)
        else:
            assert torch.equal(results[0][i], expected), (name, i)
