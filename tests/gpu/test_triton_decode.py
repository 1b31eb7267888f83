"""The compiled Triton paged decode kernel on a CUDA device: accuracy, reproducibility, CUDA-graph replay."""

import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytestmark = pytest.mark.gpu
triton = pytest.importorskip("triton")

from references import random_paged_decode_inputs  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import torpor.engine.attention.triton_decode as td  # noqa: E402
from torpor.engine.attention.reference import paged_decode_attention_reference  # noqa: E402

if isinstance(td._decode_split_kernel, InterpretedFunction):
    pytest.skip(
        "TRITON_INTERPRET is set in this process (the CPU interpreter tests set it): "
        "run tests/gpu in its own pytest process",
        allow_module_level=True,
    )

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}  # max error / max |ref|
QWEN3_8B = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}


def random_context_lens(num_seqs: int, seed: int) -> list[int]:
    """Edge lengths (1, around a block boundary) and random ones up to a few thousand tokens."""
    rng = random.Random(seed)
    lens = [1, 15, 16, 17, 4097][: num_seqs - 1]
    return lens + [rng.randint(1, 3000) for _ in range(num_seqs - len(lens))]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (32, 8, 128, 16),  # qwen3-8b / llama-3.1-8b
        (16, 8, 128, 32),  # qwen3-0.6b
        (12, 2, 64, 64),  # qwen2.5-1.5b-like grouping of 6
        (8, 8, 256, 16),  # multi-head, widest head_dim
    ],
)
@pytest.mark.parametrize("num_seqs", [1, 7, 40])
def test_matches_reference(dtype, num_q_heads, num_kv_heads, head_dim, block_size, num_seqs):
    context_lens = random_context_lens(num_seqs, seed=num_seqs)
    q, k_cache, v_cache, block_tables, lens = random_paged_decode_inputs(
        context_lens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device="cuda",
        seed=num_seqs,
    )
    scale = head_dim**-0.5
    ref = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, lens, scale)
    for num_splits in (None, 1, 5):
        out = torch.full_like(q, float("nan"))
        td.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale, out, num_splits=num_splits)
        assert torch.isfinite(out).all(), f"num_splits={num_splits}"
        error = relative_error(out, ref)
        assert error < TOLERANCE[dtype], f"num_splits={num_splits}: relative error {error:.2e}"


def test_bit_reproducible():
    inputs = random_paged_decode_inputs([1, 300, 5000, 2049], dtype=torch.bfloat16, device="cuda", **QWEN3_8B)
    outs = []
    for fill in (0.0, float("nan")):  # stale workspace contents must not matter
        workspace = td.alloc_decode_workspace(4, 32, 8, 128, inputs[3].shape[1], 16, "cuda").fill_(fill)
        out = torch.empty_like(inputs[0])
        outs.append(td.paged_decode_attention(*inputs, 128**-0.5, out, workspace=workspace))
    assert torch.equal(outs[0], outs[1])


def test_cuda_graph_replay_matches_eager():
    # the graph's buffers, sized for the largest inputs below; each replay gets new contents copied in
    max_num_seqs, max_blocks_per_seq = 8, 320
    q, k_cache, v_cache, block_tables, context_lens = random_paged_decode_inputs(
        [max_blocks_per_seq * 16] * max_num_seqs,
        dtype=torch.bfloat16,
        device="cuda",
        max_blocks_per_seq=max_blocks_per_seq,
        poison_unused=False,
        **QWEN3_8B,
    )
    q = q.clone()
    out = torch.empty_like(q)
    workspace = td.alloc_decode_workspace(max_num_seqs, 32, 8, 128, max_blocks_per_seq, 16, "cuda")

    def step():
        td.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, 128**-0.5, out, workspace=workspace)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles the kernels before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for seed, lens in enumerate([[1, 17, 4000, 5000, 16, 2, 800, 333], [5119, 0, 64, 65, 1, 1, 1, 3000]]):
        fresh = random_paged_decode_inputs(
            lens, dtype=torch.bfloat16, device="cuda", seed=seed + 1, max_blocks_per_seq=max_blocks_per_seq, **QWEN3_8B
        )
        num_blocks = fresh[1].shape[0]
        for buffer, value in zip((q, k_cache, v_cache, block_tables, context_lens), fresh, strict=True):
            buffer[:num_blocks].copy_(value)  # caches: the new blocks land in the first num_blocks
        graph.replay()
        eager = torch.empty_like(out)
        td.paged_decode_attention(*fresh, 128**-0.5, eager, workspace=torch.empty_like(workspace))
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        ref = paged_decode_attention_reference(*fresh, 128**-0.5)
        assert relative_error(out, ref) < TOLERANCE[torch.bfloat16]
