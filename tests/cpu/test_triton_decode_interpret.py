"""The Triton paged decode kernel, run on CPU tensors by Triton's interpreter, against the fp32 reference."""

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
    # 3.6's interpreter loads a scalar as a 1-element array, which the kernel's data-dependent range() rejects
    pytest.skip(f"the Triton interpreter tests need triton >= 3.7, found {triton.__version__}", allow_module_level=True)
if not isinstance(triton.language.cdiv, InterpretedFunction):
    pytest.skip(
        "triton was imported before TRITON_INTERPRET=1 could be set: run this file in its own pytest process",
        allow_module_level=True,
    )

from references import random_paged_decode_inputs  # noqa: E402

import torpor.engine.attention.triton_decode as td  # noqa: E402
from torpor.engine.attention.reference import paged_decode_attention_reference  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}  # max error / max |ref|


def make_case(
    context_lens,
    *,
    num_q_heads=8,
    num_kv_heads=2,
    head_dim=32,
    block_size=16,
    dtype=torch.float32,
    seed=0,
    max_blocks_per_seq=None,
):
    return random_paged_decode_inputs(
        context_lens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
        max_blocks_per_seq=max_blocks_per_seq,
    )


def run_and_compare(case, **kwargs):
    q, k_cache, v_cache, block_tables, context_lens = case
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))
    result = td.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out, **kwargs)
    assert result is out
    ref = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)
    assert torch.isfinite(out).all()
    error = (out.float() - ref).abs().max().item() / ref.abs().max().item()
    assert error < TOLERANCE[q.dtype], f"relative error {error:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])
def test_matches_reference_gqa(dtype, num_splits):
    # lengths: 1, one short of a block, exactly one block, one past it, several blocks and a partial one
    case = make_case([1, 15, 16, 17, 75], dtype=dtype, seed=num_splits or 0)
    run_and_compare(case, num_splits=num_splits)


@pytest.mark.parametrize(
    ("block_size", "num_q_heads", "num_kv_heads", "head_dim", "dtype"),
    [
        (32, 4, 4, 16, torch.float16),  # multi-head attention, no grouping
        (64, 6, 1, 64, torch.float32),  # multi-query, a group that is not a power of two
        (16, 32, 8, 128, torch.bfloat16),  # qwen3-8b geometry
    ],
)
def test_matches_reference_geometries(block_size, num_q_heads, num_kv_heads, head_dim, dtype):
    case = make_case(
        [3, 70],
        block_size=block_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
    )
    run_and_compare(case, num_splits=2)


def test_zero_context_gives_zeros():
    # CUDA-graph padding rows have context length 0: they must come out as zeros, not NaN
    q, k_cache, v_cache, block_tables, _ = make_case([20, 5])
    for num_splits in (1, 4):
        out = torch.full_like(q, float("nan"))
        td.paged_decode_attention(
            q, k_cache, v_cache, block_tables, torch.tensor([0, 5], dtype=torch.int32), 1.0, out, num_splits=num_splits
        )
        assert (out[0] == 0).all() and torch.isfinite(out[1]).all()


def test_caller_workspace_fits_every_batch_size():
    max_num_seqs, max_blocks_per_seq = 6, 8
    shape = td.decode_workspace_shape(max_num_seqs, 8, 2, 32, max_blocks_per_seq, 16, torch.device("cpu"))
    workspace = torch.full(shape, float("nan"))
    for num_seqs in (1, 2, max_num_seqs):
        case = make_case([1 + 19 * i for i in range(num_seqs)], max_blocks_per_seq=max_blocks_per_seq)
        run_and_compare(case, workspace=workspace)
    with pytest.raises(ValueError, match="workspace has 4 elements"):
        run_and_compare(make_case([40, 9]), workspace=torch.empty(4), num_splits=3)


def test_num_splits_is_static_and_bounded():
    cpu = torch.device("cpu")
    assert td.num_decode_splits(1, 1, 1000, 16, cpu) > 1  # a lone sequence is split to fill the device
    assert td.num_decode_splits(1, 1, 1, 16, cpu) == 1  # ... but never below 64 tokens per split
    assert td.num_decode_splits(512, 8, 1000, 16, cpu) == 1


def test_rejects_bad_inputs():
    q, k_cache, v_cache, block_tables, context_lens = make_case([5])
    out = torch.empty_like(q)
    call = td.paged_decode_attention
    with pytest.raises(ValueError, match="block_tables must be int32"):
        call(q, k_cache, v_cache, block_tables.long(), context_lens, 1.0, out)
    with pytest.raises(ValueError, match="context_lens must be int32"):
        call(q, k_cache, v_cache, block_tables, context_lens.long(), 1.0, out)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        call(q[:, :3], k_cache, v_cache, block_tables, context_lens, 1.0, out[:, :3])
    with pytest.raises(ValueError, match="power of two"):
        call(q[..., :24], k_cache[..., :24], v_cache[..., :24], block_tables, context_lens, 1.0, out[..., :24])
    with pytest.raises(ValueError, match="must share one of"):
        call(q, k_cache.half(), v_cache.half(), block_tables, context_lens, 1.0, out)


def test_reference_matches_dense_attention():
    # the reference itself, against PyTorch's attention over the same keys gathered densely
    q, k_cache, v_cache, block_tables, context_lens = make_case([37])
    blocks = block_tables[0, :3].long()
    keys = k_cache[blocks].flatten(0, 1)[:37].transpose(0, 1)  # [num_kv_heads, 37, head_dim]
    values = v_cache[blocks].flatten(0, 1)[:37].transpose(0, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(q[0][:, None], keys, values, enable_gqa=True)
    ref = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, 32**-0.5)
    torch.testing.assert_close(ref[0], dense[:, 0])


def shared_prefix_case(context_lens, shared_blocks, *, num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
                       dtype=torch.float32, seed=0):
    """Two layouts of the same logical KV: `shared` has each group's members point at the leader's physical
    blocks for the first `shared_blocks[i]` blocks (prefix caching, n samples); `copied` gives every sequence
    its own blocks holding the same values. shared_blocks[i] = (leader index, number of blocks) or None."""
    q, k_cache, v_cache, tables, lens = make_case(context_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                                  head_dim=head_dim, block_size=block_size, dtype=dtype, seed=seed)
    shared = tables.clone()
    for seq, spec in enumerate(shared_blocks):
        if spec is None:
            continue
        leader, count = spec
        for b in range(count):
            k_cache[tables[seq, b]] = k_cache[tables[leader, b]]  # the copied layout: same values, own block
            v_cache[tables[seq, b]] = v_cache[tables[leader, b]]
            shared[seq, b] = tables[leader, b]
    return q, k_cache, v_cache, shared, tables, lens


def decode(q, k_cache, v_cache, tables, lens):
    out = torch.full_like(q, float("nan"))
    return td.paged_decode_attention(q, k_cache, v_cache, tables, lens, q.shape[-1] ** -0.5, out, num_splits=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sequences_sharing_a_prefix_are_computed_right(dtype):
    """n samples of one prompt (blocks shared by reference) are computed as one group that reads the shared
    prefix once; each sequence's output matches the layout where nothing is shared, and the reference. (On the
    GPU the two layouts are bit-identical: tests/gpu/test_triton_decode.py. The interpreter's tl.dot is numpy's
    matmul, whose rounding may depend on a row's position in the tile.)"""
    # seqs 0-4 share 6 blocks (96 tokens) of seq 0; 5 stands alone; 6-7 share 2 blocks (32 < BLOCK_N tokens:
    # grouped, no prefix read together); 8 is shorter than BLOCK_N; 9 is a CUDA-graph padding row.
    lens = [130, 100, 96, 97, 161, 120, 70, 75, 40, 0]
    specs = [None, (0, 6), (0, 6), (0, 6), (0, 6), None, None, (6, 2), None, None]
    q, k_cache, v_cache, shared, tables, lens_t = shared_prefix_case(lens, specs, dtype=dtype)
    alone = decode(q, k_cache, v_cache, tables, lens_t)
    together = decode(q, k_cache, v_cache, shared, lens_t)
    ref = paged_decode_attention_reference(q, k_cache, v_cache, shared, lens_t, q.shape[-1] ** -0.5)
    for out in (alone, together):
        error = (out.float() - ref).abs().amax(dim=(1, 2)) / ref.abs().max()
        assert (error < TOLERANCE[dtype]).all(), f"relative error per sequence {error.tolist()}"
    assert (together[9] == 0).all() and torch.isfinite(together).all()


def test_more_sharing_sequences_than_a_group_holds():
    """20 sequences on one prefix (one kv head of 4 query heads: groups of 8, 8 and 4), with the group
    leaders' own lengths differing: every sequence still right."""
    lens = [64 + 7 * i for i in range(20)]
    q, k_cache, v_cache, shared, _, lens_t = shared_prefix_case(
        lens, [None] + [(0, 4)] * 19, num_q_heads=8, num_kv_heads=2, head_dim=16)
    ref = paged_decode_attention_reference(q, k_cache, v_cache, shared, lens_t, q.shape[-1] ** -0.5)
    error = (decode(q, k_cache, v_cache, shared, lens_t) - ref).abs().amax(dim=(1, 2)) / ref.abs().max()
    assert (error < TOLERANCE[torch.float32]).all(), f"relative error per sequence {error.tolist()}"
