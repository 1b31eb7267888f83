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

from references import random_paged_decode_inputs, shared_prefix_decode_inputs  # noqa: E402

import torpor.engine.attention.triton_decode as td  # noqa: E402
from tests.references import paged_decode_attention_reference  # noqa: E402

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


# Prompts (prefix length, own lengths of its samples): a group larger than one tile holds, prefixes of one
# and of several splits, a prompt without a shareable prefix, and own parts from one token to several blocks.
PREFIX_CASE = [(48, [1, 5, 17, 30, 2, 3, 9, 11, 40]), (32, [2, 3]), (0, [7, 40]), (16, [1])]


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize(("num_splits", "prefix_splits"), [(None, None), (1, 1), (2, 3)])
def test_shared_prefixes_match_reference(shared, num_splits, prefix_splits):
    # the samples of a prompt reading its prefix once per group (shared) or each its own copy, alone
    q, k_cache, v_cache, block_tables, context_lens, prefixes = shared_prefix_decode_inputs(
        PREFIX_CASE, num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32,
        shared=shared, num_padding=2, max_group_members=td.max_group_members(8, 2))
    scale = 32**-0.5
    out = torch.full_like(q, float("nan"))
    td.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out, num_splits=num_splits,
                              prefixes=prefixes, num_prefix_splits=prefix_splits)
    ref = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)
    assert torch.isfinite(out).all()
    assert (out[-2:] == 0).all()  # padding rows: context 0, no prefix, alone
    error = (out - ref).abs().max().item() / ref.abs().max().item()
    assert error < TOLERANCE[torch.float32], f"relative error {error:.2e}"


def test_a_prefix_tile_holds_whole_members():
    # 16 rows at least: 4 samples of qwen3-8b (4 q heads per kv head), 8 of qwen3-0.6b (2); never a part of one
    assert td.max_group_members(32, 8) == 4 and td.max_group_members(16, 8) == 8
    assert td.max_group_members(12, 2) == 2 and td.max_group_members(64, 1) == 1


def test_prefix_workspace_fits_every_batch_size():
    shape = td.decode_workspace_shape(12, 8, 2, 32, 8, 16, torch.device("cpu"), prefixes=True)
    assert shape[0] > td.decode_workspace_shape(12, 8, 2, 32, 8, 16, torch.device("cpu"))[0]
    case = shared_prefix_decode_inputs(PREFIX_CASE[:2], num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
                                       dtype=torch.float32, shared=True)
    q, k_cache, v_cache, block_tables, context_lens, prefixes = case
    out = torch.empty_like(q)
    workspace = torch.full(td.decode_workspace_shape(len(q), 8, 2, 32, block_tables.shape[1], 16,
                                                     torch.device("cpu"), prefixes=True), float("nan"))
    td.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, 1.0, out, prefixes=prefixes,
                              workspace=workspace)
    assert torch.isfinite(out).all()


def test_rejects_bad_prefixes():
    q, k_cache, v_cache, block_tables, context_lens, prefixes = shared_prefix_decode_inputs(
        PREFIX_CASE[:1], num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, shared=True)
    out = torch.empty_like(q)
    bad = td.DecodePrefixes(prefixes.prefix_lens, prefixes.group_starts[:-1], prefixes.group_members)
    with pytest.raises(ValueError, match=r"prefixes.group_starts must be a contiguous int32 \[10\]"):
        td.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, 1.0, out, prefixes=bad)
    bad = td.DecodePrefixes(prefixes.prefix_lens.long(), prefixes.group_starts, prefixes.group_members)
    with pytest.raises(ValueError, match=r"prefixes\.prefix_lens"):
        td.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, 1.0, out, prefixes=bad)
