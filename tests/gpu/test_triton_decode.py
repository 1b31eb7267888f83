"""The compiled Triton paged decode kernel on a CUDA device: accuracy, reproducibility, CUDA-graph replay."""

import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytestmark = pytest.mark.gpu
triton = pytest.importorskip("triton")

from references import random_paged_decode_inputs, shared_prefix_decode_inputs  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import torpor.engine.attention.triton_decode as td  # noqa: E402
from tests.references import paged_decode_attention_reference  # noqa: E402

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


def captured(step) -> torch.cuda.CUDAGraph:
    """`step` run once eagerly on a side stream (the kernels compile before the capture), then captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


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

    graph = captured(step)

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


def grpo_groups(num_prompts: int, n: int, prompt_len: int, seed: int) -> list[tuple[int, list[int]]]:
    """num_prompts prompts of prompt_len tokens (full blocks) with n samples of 1..300 own tokens each."""
    rng = random.Random(seed)
    return [(prompt_len, [rng.randint(1, 300) for _ in range(n)]) for _ in range(num_prompts)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim", "block_size"),
                         [(32, 8, 128, 16), (16, 8, 128, 32), (12, 2, 64, 16)])
@pytest.mark.parametrize("num_prompts", [1, 9, 64])
def test_shared_prefixes_are_bit_identical_to_each_sequence_alone(dtype, num_q_heads, num_kv_heads, head_dim,
                                                                  block_size, num_prompts):
    # prefix caching on (the samples of a prompt share its blocks: one group reads the prefix once) against off
    # (each sample its own copy of the same K/V: every sequence alone): the same bits, and right
    groups = [*grpo_groups(num_prompts, 8, 512, seed=num_prompts), (0, [5, 700]), (256, [1])]
    kwargs = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                  dtype=dtype, device="cuda", num_padding=3, max_group_members=td.max_group_members(
                      num_q_heads, num_kv_heads))
    outs = []
    for shared in (True, False):
        q, k_cache, v_cache, block_tables, lens, prefixes = shared_prefix_decode_inputs(groups, shared=shared,
                                                                                        **kwargs)
        out = torch.full_like(q, float("nan"))
        td.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, head_dim**-0.5, out, prefixes=prefixes)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    ref = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, lens, head_dim**-0.5)
    assert torch.isfinite(outs[0]).all() and (outs[0][-3:] == 0).all()
    assert relative_error(outs[0], ref) < TOLERANCE[dtype]


def test_shared_prefixes_in_a_cuda_graph_follow_new_groups():
    # the graph's buffers hold one step's groups; the next step's groups (other prompts, other sizes) replay right
    groups = [grpo_groups(6, 8, 512, seed=1), [*grpo_groups(3, 16, 768, seed=2), (0, [9] * 8)]]
    kwargs = dict(dtype=torch.bfloat16, device="cuda", max_group_members=td.max_group_members(32, 8), **QWEN3_8B)
    cases = [shared_prefix_decode_inputs(g, shared=True, num_padding=56 - sum(len(o) for _, o in g), **kwargs)
             for g in groups]
    width = max(c[3].shape[1] for c in cases)
    num_blocks = max(c[1].shape[0] for c in cases)
    q = torch.empty_like(cases[0][0])
    k_cache = torch.zeros(num_blocks, *cases[0][1].shape[1:], dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    block_tables = torch.zeros(56, width, dtype=torch.int32, device="cuda")
    lens = torch.empty_like(cases[0][4])
    prefixes = td.DecodePrefixes(*(torch.empty_like(t) for t in _prefix_tensors(cases[0][5])))
    out = torch.empty_like(q)
    splits = dict(num_splits=1, num_prefix_splits=2)  # the graph's and the eager call's alike
    workspace = torch.empty(56 * 32 * 3 * (128 + 1), dtype=torch.float32, device="cuda")  # 3 splits per row

    def step():
        td.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 128**-0.5, out, prefixes=prefixes,
                                  workspace=workspace, **splits)

    for buffer, value in zip((q, lens, *_prefix_tensors(prefixes)), (cases[0][0], cases[0][4],
                                                                     *_prefix_tensors(cases[0][5])), strict=True):
        buffer.copy_(value)
    graph = captured(step)
    for case in cases:
        fresh_q, fresh_k, fresh_v, fresh_tables, fresh_lens, fresh_prefixes = case
        k_cache.zero_()[: fresh_k.shape[0]].copy_(fresh_k)
        v_cache.zero_()[: fresh_v.shape[0]].copy_(fresh_v)
        block_tables.zero_()[:, : fresh_tables.shape[1]].copy_(fresh_tables)
        for buffer, value in zip((q, lens, *_prefix_tensors(prefixes)),
                                 (fresh_q, fresh_lens, *_prefix_tensors(fresh_prefixes)), strict=True):
            buffer.copy_(value)
        graph.replay()
        eager = torch.empty_like(out)
        td.paged_decode_attention(*case[:5], 128**-0.5, eager, prefixes=fresh_prefixes,
                                  workspace=torch.empty_like(workspace), **splits)
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        assert relative_error(out, paged_decode_attention_reference(*case[:5], 128**-0.5)) < TOLERANCE[torch.bfloat16]


def _prefix_tensors(prefixes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return prefixes.prefix_lens, prefixes.group_starts, prefixes.group_members
