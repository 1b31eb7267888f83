"""`LLM(memory=MemoryManager("cpu"))`: every persistent buffer lands in its tag, nothing is allocated in a
tag after start-up, and a sleep/wake cycle of the tags leaves the answers bit-identical."""

import pytest
import torch

from torpor.engine import LLM, SamplingParams
from torpor.memory import MemoryManager
from torpor.synthetic import make_model

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1),
    SamplingParams(temperature=0.9, top_p=0.8, top_k=20, max_tokens=10, seed=7, logprobs=0),
    SamplingParams(temperature=0.0, max_tokens=20, stop=["e"]),
]
PROMPTS = ["def greet(name):", [5, 6, 7, 8, 9, 10, 11], "The quick brown fox"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_model("tiny", tmp_path_factory.mktemp("tiny"), dtype="float32", progress=False)
    memory = MemoryManager("cpu")
    llm = LLM(str(path), device="cpu", max_model_len=64, max_num_seqs=4, block_size=4, memory=memory)
    return llm, memory, path


def tag_of(memory: MemoryManager, tensor: torch.Tensor) -> str | None:
    segment = memory._backend.find(tensor.data_ptr())
    return None if segment is None else segment.tag


def summary(outputs):
    return [(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].text) for o in outputs]


def test_every_persistent_buffer_is_in_its_tag(engine):
    llm, memory, _ = engine
    runner = llm.engine.executor.driver.runner
    usage = memory.usage()
    for tag in ("weights", "kv_cache", "runtime"):
        assert usage[tag].allocated_bytes > 0, tag
    model_tensors = [*runner.model.parameters(), *runner.model.buffers()]
    assert {tag_of(memory, t) for t in model_tensors} == {"weights"}
    assert usage["weights"].allocated_bytes >= sum(t.nbytes for t in model_tensors)
    assert tag_of(memory, runner.kv_cache) == "kv_cache"
    assert usage["kv_cache"].allocated_bytes >= runner.kv_cache.nbytes
    layer = runner.model.model.layers[1].self_attn.attn
    assert tag_of(memory, layer.k_cache) == tag_of(memory, layer.v_cache) == "kv_cache"
    runtime = [runner.buffers.tokens, runner.buffers.lens_tables, runner.buffers.hidden,
               runner.sampler._inputs, runner.sampler._staging]
    assert {tag_of(memory, t) for t in runtime} == {"runtime"}
    assert "workspace" not in usage or usage["workspace"].allocated_bytes == 0  # CPU: no decode workspace


def test_nothing_is_allocated_in_a_tag_after_start_up(engine):
    llm, memory, _ = engine
    llm.generate(PROMPTS, PARAMS)  # start-up generation
    for tag in memory.tags():
        memory.seal(tag)
    llm.generate(PROMPTS * 2, PARAMS * 2)  # more sequences than max_num_seqs
    assert memory.audit().late_allocations == ()


def test_sleep_and_wake_give_bit_identical_answers(engine):
    llm, memory, path = engine
    llm.reset_prefix_cache()  # from an empty prefix cache, like the fresh engine below
    before = summary(llm.generate(PROMPTS, PARAMS))
    memory.sleep({"weights": "offload", "kv_cache": "discard", "runtime": "offload"})
    assert memory.usage()["kv_cache"].discarded_bytes > 0
    memory.wake()
    # The KV cache was discarded behind the engine's back (LLM.sleep / wake_up tell the engine themselves):
    # its prefix cache must forget the blocks.
    llm.reset_prefix_cache()
    assert summary(llm.generate(PROMPTS, PARAMS)) == before
    # the same engine without a MemoryManager computes the same thing
    plain = LLM(str(path), device="cpu", max_model_len=64, max_num_seqs=4, block_size=4)
    assert summary(plain.generate(PROMPTS, PARAMS)) == before
