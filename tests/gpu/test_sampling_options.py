"""The sampling options on CUDA: the processed logits equal the CPU sampler's at a real vocabulary size,
each request's tokens do not depend on its batch or the run, the token history lives in the runtime tag,
and `LLM.generate` with the options gives the CPU engine's greedy tokens (fp32) and graphs == eager."""

import gc

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from torpor.engine import LLM, SamplingParams  # noqa: E402
from torpor.engine.sampler import Sampler  # noqa: E402
from torpor.engine.sequence import Sequence  # noqa: E402
from torpor.synthetic import make_model  # noqa: E402

VOCAB = 151936  # Qwen3's
EOS = (151643, 151645)
MAX_LEN = 2048
OPTIONS = [
    dict(temperature=0.0),
    dict(temperature=0.9, top_p=0.9),
    dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5),
    dict(temperature=0.8, repetition_penalty=0.8, logit_bias={5: 3.0, 151643: -2.0}, min_tokens=40),
    dict(temperature=1.0, min_p=0.05, frequency_penalty=-0.5, stop_token_ids=[7]),
    dict(temperature=0.7, top_k=50, min_p=0.1, presence_penalty=1.0),
]


def make_seqs(count, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Sequence(str(i), torch.randint(0, VOCAB, (int(torch.randint(1, 1500, (), generator=g)),),
                                           generator=g).tolist(),
                     SamplingParams(seed=i, max_tokens=64, **OPTIONS[i % len(OPTIONS)])) for i in range(count)]


def logits_for(seqs, step):
    rows = [torch.randn(VOCAB, generator=torch.Generator().manual_seed(1000 * int(s.request_id) + step)) * 4
            for s in seqs]
    return torch.stack(rows)


def run(sampler, seqs, steps, device):
    for step in range(steps):
        out = sampler(logits_for(seqs, step).to(device), seqs)
        for seq, token in zip(seqs, out.token_ids, strict=True):
            seq.append_token(token)
    return {s.request_id: s.output_token_ids for s in seqs}


def test_processed_logits_equal_the_cpu_samplers():
    seqs = make_seqs(48)
    for seq in seqs:
        for token in range(10):
            seq.append_token(token * 7)
    logits = logits_for(seqs, 0)
    on_cpu = Sampler(64, "cpu", MAX_LEN, EOS)._process_logits(logits, seqs)
    on_gpu = Sampler(64, "cuda", MAX_LEN, EOS)._process_logits(logits.cuda(), seqs).cpu()
    torch.testing.assert_close(on_gpu, on_cpu, rtol=1e-6, atol=1e-5)


def test_tokens_do_not_depend_on_the_batch_or_the_run():
    alone = {}
    for i in range(len(OPTIONS)):
        alone.update(run(Sampler(64, "cuda", MAX_LEN, EOS), make_seqs(64)[i:i + 1], 24, "cuda"))
    together = run(Sampler(64, "cuda", MAX_LEN, EOS), make_seqs(64), 24, "cuda")
    again = run(Sampler(64, "cuda", MAX_LEN, EOS), make_seqs(64), 24, "cuda")
    assert together == again
    assert {k: together[k] for k in alone} == alone


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("sampling") / "tiny", dtype="float32", progress=False)


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.5, logprobs=3),
    SamplingParams(temperature=0.0, max_tokens=30, frequency_penalty=1.0, presence_penalty=0.5,
                   logit_bias={1023: 5.0}, min_tokens=10),
    SamplingParams(temperature=0.9, max_tokens=30, seed=4, min_p=0.1, repetition_penalty=1.2, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
]
PROMPTS = [[5, 6, 7, 5, 6, 7], list(range(40, 90)), [3], list(range(200, 230))]


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_generate_with_options_on_cuda(checkpoint):
    common = dict(dtype="float32", max_model_len=256, max_num_seqs=8, block_size=16)
    llm = LLM(str(checkpoint), device="cuda", num_kv_blocks=64, **common)
    backend = llm.memory._backend
    assert backend.find(llm.engine.executor.driver.runner.sampler.history.rows.data_ptr()).tag == "runtime"
    graphs = llm.generate(PROMPTS, PARAMS)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    eager = LLM(str(checkpoint), device="cuda", num_kv_blocks=64, enforce_eager=True, **common)
    assert tokens(eager.generate(PROMPTS, PARAMS)) == tokens(graphs)
    del eager
    gc.collect()
    torch.cuda.empty_cache()
    cpu = LLM(str(checkpoint), device="cpu", **common)
    greedy = [i for i, p in enumerate(PARAMS) if p.is_greedy]
    cpu_tokens = tokens(cpu.generate([PROMPTS[i] for i in greedy], [PARAMS[i] for i in greedy]))
    assert cpu_tokens == [tokens(graphs)[i] for i in greedy]
