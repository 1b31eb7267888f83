"""vLLM's surface on CUDA (tiny bf16 model, CUDA graphs): `LLM.chat` with the real Qwen3 template,
`collective_rpc` sleep / wake / reload at levels 1 and 2 with answers (tokens and `Logprob` entries)
bit-identical afterwards, and the device memory actually released while asleep."""

import gc
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from torpor import LLM, Logprob, SamplingParams  # noqa: E402
from torpor.synthetic import make_model  # noqa: E402

QWEN3 = (Path(__file__).parent.parent / "data" / "chat_templates" / "qwen3-0.6b.jinja").read_text()
CONVERSATIONS = [[{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}] for i in range(6)]
PARAMS = SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_model("tiny", tmp_path_factory.mktemp("surface") / "tiny", dtype="bfloat16", progress=False)
    engine = LLM(str(path), device="cuda", max_model_len=256, max_num_seqs=8, num_kv_blocks=128)
    yield engine
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def answers(llm):
    outputs = llm.chat(CONVERSATIONS, PARAMS, chat_template=QWEN3, chat_template_kwargs={"enable_thinking": False})
    assert all(o.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for o in outputs)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


@pytest.mark.parametrize("level", [1, 2])
def test_collective_rpc_sleep_wake_is_bit_exact(llm, level):
    reference = answers(llm)
    assert all(isinstance(e, Logprob) for _, lps in reference for lp in lps for e in lp.values())
    awake = llm.collective_rpc("memory_usage")[0]["device_used_bytes"]
    assert llm.collective_rpc("sleep", kwargs={"level": level, "mode": "wait"})[0] is not None
    asleep = llm.collective_rpc("memory_usage")[0]["device_used_bytes"]
    print(f"surface level {level}: device memory in use awake {awake / 2**20:.0f} MiB, asleep {asleep / 2**20:.0f} MiB")
    assert asleep < awake
    assert llm.collective_rpc("is_sleeping") == [True]
    llm.collective_rpc("wake_up", kwargs={"tags": ["weights"]})
    if level == 2:
        llm.collective_rpc("reload_weights")
    llm.collective_rpc("wake_up")
    assert llm.collective_rpc("is_sleeping") == [False]
    assert answers(llm) == reference
