"""The engine's GPU attention path (TritonAttentionBackend, decode batches padded to graph buckets with
scratch slots) run on CPU by Triton's interpreter, against the CPU engine."""

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("the interpreter tests run on machines without CUDA; tests/gpu covers it", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported
triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 7):
    pytest.skip(f"the Triton interpreter tests need triton >= 3.7, found {triton.__version__}", allow_module_level=True)
if not isinstance(triton.language.cdiv, InterpretedFunction):
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set: run this file in its own pytest "
                "process", allow_module_level=True)

from torpor.engine import LLM, SamplingParams  # noqa: E402
from torpor.engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from torpor.synthetic import make_model  # noqa: E402


def test_triton_backend_with_padded_decode_matches_the_cpu_engine(tmp_path):
    path = str(make_model("tiny", tmp_path / "tiny", dtype="float32", progress=False))
    options = dict(device="cpu", max_model_len=96, max_num_seqs=12, block_size=16)
    reference, llm = LLM(path, **options), LLM(path, **options)
    runner = llm.engine.executor.driver.runner
    backend = TritonAttentionBackend()
    backend.workspace = torch.empty(runner._workspace_numel(runner.config), dtype=torch.float32)
    for layer in runner.model.model.layers:
        layer.self_attn.attn.backend = backend
    runner.pad_decode_batches = True  # 5 sequences run as a batch of 8: 3 rows on the scratch slot
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (3, 17, 30, 5, 40)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
    expected, got = reference.generate(prompts, params), llm.generate(prompts, params)
    for want, out in zip(expected, got, strict=True):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(out.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys() and all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)
    scratch = runner.kv_cache[:, :, runner.config.num_kv_blocks]
    assert scratch.abs().sum() > 0  # the padded rows really wrote there (and only there: outputs match)


def test_triton_backend_prefill_over_cached_prefixes_and_forked_samples(tmp_path):
    """The GPU prefill path over a cached prefix (K/V gathered from the paged cache, masked SDPA) and n forked
    samples (the copied last block read by the decode kernel), against the CPU engine without caching."""
    path = str(make_model("tiny", tmp_path / "tiny", dtype="float32", progress=False))
    options = dict(device="cpu", max_model_len=96, max_num_seqs=12, block_size=16)
    reference, llm = LLM(path, enable_prefix_caching=False, **options), LLM(path, **options)
    runner = llm.engine.executor.driver.runner
    backend = TritonAttentionBackend()
    backend.workspace = torch.empty(runner._workspace_numel(runner.config), dtype=torch.float32)
    for layer in runner.model.model.layers:
        layer.self_attn.attn.backend = backend
    g = torch.Generator().manual_seed(1)
    head = torch.randint(0, 1000, (35,), generator=g).tolist()
    prompts = [head + torch.randint(0, 1000, (n,), generator=g).tolist() for n in (1, 9, 20)]
    params = SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=6, ignore_eos=True, logprobs=1)
    expected = reference.generate(prompts, params)
    llm.generate(prompts, params)  # the heads are cached now
    got = llm.generate(prompts, params)
    assert [o.num_cached_tokens for o in got] == [32, 32, 48]
    for want, out in zip(expected, got, strict=True):
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in want.outputs]
        for a, b in zip(out.outputs, want.outputs, strict=True):
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.keys() == y.keys() and all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4) for t in x)


def test_triton_backend_reads_shared_prompt_prefixes_once_per_group(tmp_path):
    """The n samples of prompts of >= MIN_PREFIX_TOKENS tokens grouped by DecodeBuffers (their prompt's full
    blocks shared by prefix caching) and decoded by the kernel's prefix path, against the CPU engine without
    caching (every sample its own prefill)."""
    from torpor.engine.attention.triton_decode import decode_workspace_shape
    from torpor.engine.inputs import DecodeBuffers

    path = str(make_model("tiny", tmp_path / "tiny", dtype="float32", progress=False))
    options = dict(device="cpu", max_model_len=128, max_num_seqs=12, block_size=16)
    reference, llm = LLM(path, enable_prefix_caching=False, **options), LLM(path, **options)
    runner = llm.engine.executor.driver.runner
    config, m = runner.config, runner.model_config
    backend = TritonAttentionBackend()
    runner.buffers = DecodeBuffers(config.max_num_seqs, config.max_num_blocks_per_seq, m.hidden_size, runner.dtype,
                                   runner.device, config.block_size, config.num_kv_blocks,
                                   backend.decode_group_size(m.num_attention_heads, m.num_key_value_heads))
    backend.workspace = torch.empty(decode_workspace_shape(
        config.max_num_seqs, m.num_attention_heads, m.num_key_value_heads, m.head_dim, config.max_num_blocks_per_seq,
        config.block_size, runner.device, prefixes=True), dtype=torch.float32)
    for layer in runner.model.model.layers:
        layer.self_attn.attn.backend = backend
    runner.pad_decode_batches = True
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (70, 100)]
    params = SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=8, ignore_eos=True, logprobs=1)
    expected, got = reference.generate(prompts, params), llm.generate(prompts, params)
    prefix_lens, starts, _ = runner.buffers._groups
    assert prefix_lens.tolist() == [64] * 3 + [96] * 3 and starts[:3].tolist() == [0, 3, 6]  # two groups of 3
    for want, out in zip(expected, got, strict=True):
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in want.outputs]
        for a, b in zip(out.outputs, want.outputs, strict=True):
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.keys() == y.keys() and all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4) for t in x)
