"""`LLM` end to end on CPU (fp32 tiny models): against transformers, determinism, sampling, logprobs,
stop conditions, preemption, and input errors."""

import pytest
import torch
import transformers

from torpor.engine import LLM, SamplingParams
from torpor.synthetic import make_model

ARCHS = ("tiny", "tiny-llama", "tiny-qwen2")
ATOL = 1e-4  # fp32 logprobs of the same model computed two ways
ENGINE = dict(device="cpu", dtype="float32", max_model_len=96, max_num_seqs=8, block_size=4)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm-models")
    return {name: make_model(name, root / name, dtype="float32", progress=False) for name in ARCHS}


@pytest.fixture(scope="module")
def tiny(checkpoints):
    return LLM(str(checkpoints["tiny"]), **ENGINE)


def random_prompts(lengths, seed, vocab=1000):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy(max_tokens=16, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_and_logprobs_match_transformers(checkpoints, arch):
    path = checkpoints[arch]
    llm = LLM(str(path), **ENGINE)
    hf = getattr(transformers, llm.engine.executor.driver.runner.model_config.architecture).from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens, like ignore_eos
    prompts = [*random_prompts([3, 9, 17], seed=1), "def greet(name):"]
    outputs = llm.generate(prompts, greedy(max_tokens=20, logprobs=3))
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert out.prompt_token_ids == ids
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0)
        completion = out.outputs[0]
        assert completion.token_ids == ref.sequences[0, len(ids):].tolist()
        assert completion.finish_reason == "length" and len(completion.logprobs) == 20
        for step, (token, logprobs) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
            expected = torch.log_softmax(ref.logits[step][0].float(), dim=-1)
            top = expected.topk(3).indices.tolist()
            assert set(logprobs) == {token, *top}, f"step {step}"
            for token_id, entry in logprobs.items():  # vLLM's Logprob: value, rank, text
                assert entry.logprob == pytest.approx(expected[token_id].item(), abs=ATOL)
                assert entry.rank == top.index(token_id) + 1
                assert entry.decoded_token == llm.tokenizer.decode([token_id], skip_special_tokens=False)
        assert completion.text == llm.tokenizer.decode(completion.token_ids)


def test_prompt_logprobs_match_transformers(checkpoints, tiny):
    hf = transformers.Qwen3ForCausalLM.from_pretrained(checkpoints["tiny"], dtype=torch.float32).eval()
    prompts = random_prompts([1, 2, 30], seed=2)
    outputs = tiny.generate(prompts, greedy(max_tokens=2, prompt_logprobs=2))
    assert outputs[0].prompt_logprobs == [None]
    for prompt, out in zip(prompts[1:], outputs[1:], strict=True):
        with torch.inference_mode():
            expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for i, logprobs in enumerate(out.prompt_logprobs[1:]):
            top = expected[i].topk(2).indices.tolist()
            assert set(logprobs) == {prompt[i + 1], *top}
            for token_id, entry in logprobs.items():
                assert entry.logprob == pytest.approx(expected[i, token_id].item(), abs=ATOL)
                assert entry.rank == (top.index(token_id) + 1 if token_id in top else None)
    assert all(o.outputs[0].logprobs is None for o in outputs)  # not asked for


def test_greedy_is_deterministic_across_runs_and_batches(tiny):
    prompts = random_prompts([5, 12, 7, 20, 3], seed=3)
    params = greedy(max_tokens=12)
    together = tokens(tiny.generate(prompts, params))
    assert tokens(tiny.generate(prompts, params)) == together
    alone = [tokens(tiny.generate([p], params))[0] for p in prompts]
    assert alone == together
    reordered = tokens(tiny.generate(prompts[::-1] + random_prompts([9], seed=4), params))
    assert reordered[:5][::-1] == together
    assert len({tuple(t) for t in together}) == len(prompts)  # the prompts really lead somewhere different


def test_seeded_sampling_is_reproducible_per_request(tiny):
    prompt = random_prompts([6], seed=5)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True, seed=42, logprobs=0)
    alone = tiny.generate([prompt], params)[0].outputs[0]
    crowd = [SamplingParams(temperature=0.7, seed=i, max_tokens=8) for i in range(3)]
    others = random_prompts([4, 11, 2], seed=6)
    mixed = tiny.generate([others[0], prompt, others[1], others[2]], [crowd[0], params, crowd[1], crowd[2]])
    assert mixed[1].outputs[0].token_ids == alone.token_ids
    # the batch changes the GEMM shapes, hence the last bits of the logprobs (not the tokens)
    for got, want in zip(mixed[1].outputs[0].logprobs, alone.logprobs, strict=True):
        assert got.keys() == want.keys()
        assert all(got[t].logprob == pytest.approx(want[t].logprob, abs=ATOL) for t in got)
    greedy_ids = tokens(tiny.generate([prompt], greedy(max_tokens=16)))[0]
    other_seed = tiny.generate([prompt], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16,
                                                        ignore_eos=True, seed=43))[0].outputs[0].token_ids
    assert alone.token_ids != greedy_ids and other_seed != alone.token_ids  # it really samples


def test_unseeded_sampling_follows_the_engine_seed(checkpoints):
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    prompts = random_prompts([4, 8], seed=7)
    runs = [tokens(LLM(str(checkpoints["tiny"]), seed=seed, **ENGINE).generate(prompts, params)) for seed in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_stop_strings_end_and_trim_the_text(tiny):
    prompt = "def greet(name):"
    full = tiny.generate([prompt], greedy(max_tokens=40))[0].outputs[0]
    text = full.text
    stop = next(text[i : i + 3] for i in range(len(text) // 2, len(text) - 3) if text[i : i + 3].strip())
    stopped = tiny.generate([prompt], greedy(max_tokens=40, stop=["never-appears", stop]))[0].outputs[0]
    assert stopped.text == text[: text.find(stop)]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop)
    assert len(stopped.token_ids) < len(full.token_ids)
    assert full.token_ids[: len(stopped.token_ids)] == stopped.token_ids


def test_stop_token_ids_and_length_limits(tiny):
    prompt = random_prompts([8], seed=8)[0]
    full = tiny.generate([prompt], greedy(max_tokens=30))[0].outputs[0]
    stop_token = full.token_ids[6]
    first = full.token_ids.index(stop_token)
    out = tiny.generate([prompt], greedy(max_tokens=30, stop_token_ids=[stop_token]))[0].outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_token)
    # prompt + max_tokens beyond max_model_len (96) is refused (it was once silently cut short)
    long_prompt = random_prompts([90], seed=9)[0]
    with pytest.raises(ValueError, match=r"together 140, beyond max_model_len \(96\).*at most 6 tokens"):
        tiny.generate([long_prompt], greedy(max_tokens=50))
    out = tiny.generate([long_prompt], greedy(max_tokens=6))[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_preemption_gives_the_same_outputs(checkpoints, tiny):
    """A KV cache of max_model_len tokens for 4 growing sequences forces recompute-preemption."""
    prompts = random_prompts([10, 14, 6, 11], seed=10)
    params = greedy(max_tokens=40, logprobs=1)
    reference = tiny.generate(prompts, params)
    small = LLM(str(checkpoints["tiny"]), **{**ENGINE, "max_model_len": 64}, num_kv_blocks=16)
    scheduler = small.engine.scheduler
    preempted = []
    real_preempt = scheduler._preempt
    scheduler._preempt = lambda seq: (preempted.append(seq.request_id), real_preempt(seq))
    outputs = small.generate(prompts, params)
    assert len(preempted) >= 2
    assert tokens(outputs) == tokens(reference)
    for out, ref in zip(outputs, reference, strict=True):
        for got, want in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
            assert got.keys() == want.keys()
            assert all(got[t].logprob == pytest.approx(want[t].logprob, abs=ATOL) for t in got)
    assert scheduler.block_manager.num_free_blocks == 16


def test_input_errors_name_the_problem(tiny):
    cases = [
        ("", "empty string"),
        ([[]], "no tokens"),
        ([], "not empty"),
        ([[1, 2, 1024]], "vocabulary"),
        ([[1, -1]], "vocabulary"),
        ([[1, True]], "vocabulary"),
        ([list(range(96))], "max_model_len"),
        ([[1, 2], "text", 3], "mix"),
    ]
    for prompts, message in cases:
        with pytest.raises(ValueError, match=message):
            tiny.generate(prompts)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        tiny.generate(["hi"], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="SamplingParams"):
        tiny.generate(["hi"], {"temperature": 0})
    with pytest.raises(ValueError, match="SamplingParams"):
        tiny.generate(["hi", "there"], [SamplingParams(), "greedy"])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    # an invalid request in a batch queues nothing
    with pytest.raises(ValueError, match="max_model_len"):
        tiny.generate(["fine", list(range(100))])
    assert tiny.engine.is_finished()
    assert tiny.generate(["fine"], greedy(max_tokens=2))[0].outputs[0].finish_reason == "length"


def test_engine_option_errors(checkpoints):
    path = str(checkpoints["tiny"])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(path, device="cpu", max_model_len=1 << 20)
    with pytest.raises(TypeError, match="unknown LLM option"):
        LLM(path, device="cpu", max_model_length=64)
    with pytest.raises(ValueError, match="dtype"):
        LLM(path, device="cpu", dtype="int8")
    with pytest.raises(ValueError, match="KV cache holds 8 blocks"):
        LLM(path, device="cpu", max_model_len=64, block_size=4, num_kv_blocks=8)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            LLM(path, device="cuda")


def test_new_token_slots_start_anywhere_in_a_block():
    from torpor.engine.inputs import new_token_slots

    table, block_size = [5, 9, 2, 7], 4
    for start in range(16):
        for end in range(start + 1, 17):
            expected = [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            assert new_token_slots(table, start, end, block_size) == expected
