"""The MoE kernels (layers/fused_moe.py) run on CPU tensors by Triton's interpreter, against the PyTorch reference
(`moe.experts_reference`), and the engine with them against the CPU engine. A row's output must not depend on its
batch: alone, among others, with other tokens choosing its experts or not, at another place in its blocks."""

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("the interpreter tests run on machines without CUDA; tests/gpu covers it", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported
triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

if not isinstance(triton.language.cdiv, InterpretedFunction):
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set: run this file in its own pytest "
                "process", allow_module_level=True)

from torpor.engine import LLM, SamplingParams  # noqa: E402
from torpor.engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from torpor.engine.models.layers import fused_moe, moe  # noqa: E402
from torpor.synthetic import make_model  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def rows_dot(monkeypatch):
    """The interpreter's fp32 tl.dot is numpy's matmul, whose BLAS (OpenBLAS on AVX-512 CPUs, e.g.) gives a row other
    bits at another place in its tile; a GPU's tl.dot row does not (tests/gpu checks it there). Here each element is
    summed in one fixed order (einsum), so that what these tests see is the kernels' own doing, not the host's BLAS."""
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (a.data.dtype == b.data.dtype == d.data.dtype == np.float32):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        return interpreter.TensorHandle(np.einsum("...mk,...kn->...mn", a.data, b.data, optimize=False) + d.data,
                                        d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def experts_case(num_tokens: int, dtype: torch.dtype, num_experts: int = 8, hidden: int = 64, inter: int = 48,
                 top_k: int = 2, seed: int = 0, skew: float = 0.0):
    """x, gate_up, down and routed (ids, weights) sorted by id; `skew` > 0 sends most tokens to expert 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    logits[:, 0] += skew
    ids, weights = moe.route(logits.to(dtype), top_k, normalize=True)
    return x, gate_up, down, *moe.by_expert_id(ids, weights)


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    else:  # fp32 accumulators in both; the interpreter's dots and PyTorch's CPU GEMMs sum in other orders
        mismatched = (out != ref).float().mean().item()
        assert mismatched < 0.02, f"{mismatched:.1%} of the elements differ"
        torch.testing.assert_close(out.float(), ref.float(), atol=0.02, rtol=0.02)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "top_k", "skew"), [(1, 2, 0.0), (13, 2, 0.0), (40, 4, 0.0), (70, 2, 8.0)])
def test_matches_the_reference(dtype, num_tokens, top_k, skew):
    """(70, skew 8): nearly every token takes expert 0, a run of several BLOCK_M blocks; some experts get none."""
    x, gate_up, down, ids, weights = experts_case(num_tokens, dtype, top_k=top_k, skew=skew)
    out = fused_moe.fused_experts(x, gate_up, down, ids, weights)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close_to_reference(out, moe.experts_reference(x, gate_up, down, ids, weights))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_has_the_same_bits_alone_and_in_any_batch(dtype):
    x, gate_up, down, ids, weights = experts_case(24, dtype, top_k=3, seed=1)
    batch = fused_moe.fused_experts(x, gate_up, down, ids, weights)
    for row in (0, 7, 23):
        alone = fused_moe.fused_experts(x[row:row + 1], gate_up, down, ids[row:row + 1], weights[row:row + 1])
        assert torch.equal(alone[0], batch[row])
    # the rows in another order and beside other tokens: each lands at another place in its experts' blocks
    others = experts_case(9, dtype, top_k=3, seed=2)
    order = torch.randperm(24, generator=torch.Generator().manual_seed(3))
    mixed = [torch.cat([a[order], b]) for a, b in zip((x, ids, weights), (others[0], others[3], others[4]),
                                                       strict=True)]
    shuffled = fused_moe.fused_experts(mixed[0], gate_up, down, mixed[1], mixed[2])
    assert torch.equal(shuffled[:24], batch[order])


def test_chunks_of_a_long_batch_change_no_row(monkeypatch):
    x, gate_up, down, ids, weights = experts_case(20, torch.bfloat16, seed=4)
    whole = fused_moe.fused_experts(x, gate_up, down, ids, weights)
    monkeypatch.setattr(fused_moe, "CHUNK_TOKENS", 6)  # 20 tokens in chunks of 6, 6, 6, 2
    assert torch.equal(fused_moe.fused_experts(x, gate_up, down, ids, weights), whole)


def test_align_by_expert_sorts_every_slot_into_blocks_of_one_expert():
    ids = torch.tensor([[0, 3], [3, 5], [0, 5], [1, 3]])
    block_m = 4
    slots, block_expert = fused_moe.align_by_expert(ids, num_experts=8, block_m=block_m)
    assert slots.shape == (fused_moe.max_blocks(8, 8, block_m) * block_m,)
    assert sorted(s for s in slots.tolist() if s < 8) == list(range(8))  # every slot once, padding holds 8
    flat = ids.reshape(-1).tolist()
    for b, expert in enumerate(block_expert.tolist()):
        rows = [s for s in slots[b * block_m:(b + 1) * block_m].tolist() if s < 8]
        if expert == 8:
            assert not rows  # past the used blocks
        else:
            assert rows and all(flat[s] == expert for s in rows) and rows == sorted(rows)
    assert block_expert.tolist()[:4] == [0, 1, 3, 5]


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "skew", "block_m"), [
    (1, 8, 2, 0.0, 16), (37, 8, 3, 0.0, 4), (300, 16, 4, 6.0, 16), (200, 128, 8, 0.0, 64)])
def test_the_align_kernels_match_their_reference(num_tokens, num_experts, top_k, skew, block_m):
    """`align` (the kernels CUDA runs; 200 x 8 slots: two chunks, 128 experts) against `align_by_expert` (what
    `fused_experts` uses on CPU tensors, in the interpreter)."""
    ids = experts_case(num_tokens, torch.float32, num_experts=num_experts, top_k=top_k, skew=skew)[3]
    slots, block_expert = fused_moe.align(ids, num_experts, block_m)
    expected_slots, expected_experts = fused_moe.align_by_expert(ids, num_experts, block_m)
    assert torch.equal(slots, expected_slots) and torch.equal(block_expert, expected_experts)


def test_bad_inputs_name_the_problem():
    x, gate_up, down, ids, weights = experts_case(3, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe.fused_experts(x, gate_up, down[:, :, :-1].contiguous(), ids, weights)
    with pytest.raises(ValueError, match="ids and weights"):
        fused_moe.fused_experts(x, gate_up, down, ids[:2], weights)


def test_the_engine_with_the_kernels_matches_the_cpu_engine(tmp_path):
    """tiny-moe (fp32) on the GPU's paths in the interpreter (the MoE kernels, Triton attention, decode batches
    padded to graph buckets): the same tokens and logprobs within 1e-4 as the CPU engine; prefix caching on or
    off the same bits."""
    path = str(make_model("tiny-moe", tmp_path / "tiny-moe", dtype="float32", progress=False))
    options = dict(device="cpu", max_model_len=96, max_num_seqs=8, block_size=16)
    reference, llm = LLM(path, enable_prefix_caching=False, **options), LLM(path, **options)
    runner = llm.engine.executor.driver.runner
    for block in runner.model.moe_blocks:
        block.use_kernels = True
    backend = TritonAttentionBackend()
    backend.workspace = torch.empty(runner._workspace_numel(runner.config), dtype=torch.float32)
    for layer in runner.model.model.layers:
        layer.self_attn.attn.backend = backend
    runner.pad_decode_batches = True  # 3 sequences run as a batch of 4
    g = torch.Generator().manual_seed(0)
    head = torch.randint(0, 1000, (33,), generator=g).tolist()
    prompts = [head + torch.randint(0, 1000, (n,), generator=g).tolist() for n in (2, 11, 25)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    expected = reference.generate(prompts, params)
    first = llm.generate(prompts, params)
    cached = llm.generate(prompts, params)  # the head's blocks come from the prefix cache now
    assert [o.num_cached_tokens for o in cached] == [32, 32, 48]
    for want, out, again in zip(expected, first, cached, strict=True):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids == again.outputs[0].token_ids
        assert again.outputs[0].logprobs == out.outputs[0].logprobs  # bit for bit: rows do not see their batch
        for a, b in zip(out.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys() and all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)
