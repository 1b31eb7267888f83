"""The staged loader on CUDA (qwen3-0.6b preset, one GPU): bit-identical to the plain loader, through
registered pinned staging buffers reused across reloads, at the same parameter addresses; the engine's
answers unchanged after a level-2 sleep and a staged reload. Prints both loaders' GB/s."""

import gc
import time
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytestmark = pytest.mark.gpu

from torpor.engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from torpor.engine.models import ModelConfig, build_model  # noqa: E402
from torpor.engine.weights.loader import load_weights, load_weights_reference, read_headers  # noqa: E402
from torpor.engine.weights.staging import StagingBuffers  # noqa: E402
from torpor.synthetic import cached_model_path  # noqa: E402


@pytest.fixture(scope="module")
def qwen3_06b() -> Path:
    return cached_model_path("qwen3-0.6b")


@pytest.fixture(autouse=True)
def release_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def new_model(path):
    model = build_model(ModelConfig.from_pretrained(path), TorchAttentionBackend(), torch.bfloat16, "cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)
    return model


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def test_staged_equals_plain_bit_for_bit(qwen3_06b):
    gb = sum(e.nbytes for e in read_headers(qwen3_06b)) / 1e9
    plain, staged = new_model(qwen3_06b), new_model(qwen3_06b)
    plain_s = timed(lambda: load_weights_reference(plain, qwen3_06b))
    staging = StagingBuffers("cuda")
    first_s = timed(lambda: load_weights(staged, qwen3_06b, staging))  # includes pinning the buffers
    assert staging.buffers and all(b.kind == "pinned" for b in staging.buffers)
    pinned = [b.ptr for b in staging.buffers]
    for (name, a), (_, b) in zip(plain.named_parameters(), staged.named_parameters(), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    addresses = [p.data_ptr() for p in staged.parameters()]
    with torch.no_grad():
        for p in staged.parameters():
            p.zero_()  # what a level-2 sleep leaves
    again_s = min(timed(lambda: load_weights(staged, qwen3_06b, staging)) for _ in range(3))
    assert [b.ptr for b in staging.buffers] == pinned and [p.data_ptr() for p in staged.parameters()] == addresses
    for (name, a), (_, b) in zip(plain.named_parameters(), staged.named_parameters(), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    staging.close()
    print(f"\nqwen3-0.6b {gb:.2f} GB: plain {plain_s:.3f} s ({gb / plain_s:.1f} GB/s), staged first "
          f"{first_s:.3f} s, staged reload {again_s:.3f} s ({gb / again_s:.1f} GB/s)")


def test_engine_answers_after_level2_and_staged_reload(qwen3_06b):
    from torpor.engine import LLM, SamplingParams

    llm = LLM(str(qwen3_06b), device="cuda", max_model_len=256, max_num_seqs=8, gpu_memory_utilization=0.5)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    before = llm.generate(prompts, params)
    llm.sleep(2)
    llm.wake_up()
    seconds = timed(llm.reload_weights)
    after = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]
    assert [o.outputs[0].logprobs for o in after] == [o.outputs[0].logprobs for o in before]
    print(f"\nlevel-2 reload of qwen3-0.6b in the engine: {seconds:.3f} s")
