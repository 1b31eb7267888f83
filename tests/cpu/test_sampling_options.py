"""The sampling options vLLM users pass (penalties, min_p, min_tokens, logit_bias, stop_token_ids,
skip_special_tokens, include_stop_str_in_output) against a plain PyTorch reference written here, per option
and combined; the token history that feeds the penalties; batch independence with every option in the mix;
then end to end through `LLM.generate` on the tiny model (against the reference over transformers' logits,
and transformers' own repetition penalty), sleep and wake included."""

import pytest
import torch
import transformers

from torpor.engine import LLM
from torpor.engine.outputs import RequestOutput
from torpor.engine.sampler import Sampler, TokenHistory
from torpor.engine.sampling_params import SamplingParams
from torpor.engine.sequence import Sequence
from torpor.memory import MemoryManager

VOCAB = 48
EOS = (46, 47)
MAX_LEN = 64


def reference_logits(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams,
                     eos: tuple[int, ...] = EOS) -> torch.Tensor:
    """One row, the options applied one token at a time: bias, min_tokens, repetition, frequency, presence."""
    x = logits.clone()
    for token, bias in p.logit_bias:
        x[token] += bias
    if len(output) < p.min_tokens:
        for token in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            x[token] = -torch.inf
    for token in set(prompt) | set(output):
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token in set(output):
        x[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return x


def reference_min_p_support(logits: torch.Tensor, temperature: float, min_p: float) -> set[int]:
    probs = torch.softmax(logits.double() / temperature, -1)
    return set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())


def make_seq(request_id, prompt=(1, 2, 3, 2), output=(), seed=0, **params) -> Sequence:
    seq = Sequence(request_id, list(prompt), SamplingParams(seed=seed, **params))
    for token in output:
        seq.append_token(token)
    return seq


def random_logits(rows, seed=0, scale=3.0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def sampler(max_num_seqs=8) -> Sampler:
    return Sampler(max_num_seqs, "cpu", MAX_LEN, EOS)


OPTIONS = {
    "repetition": dict(repetition_penalty=1.7),
    "repetition<1": dict(repetition_penalty=0.6),
    "frequency": dict(frequency_penalty=1.3),
    "presence": dict(presence_penalty=-0.8),
    "logit_bias": dict(logit_bias={5: 7.5, 9: -100.0, 1: 2.0}),
    "min_tokens": dict(min_tokens=6, stop_token_ids=[11]),
    "min_tokens+ignore_eos": dict(min_tokens=6, stop_token_ids=[11], ignore_eos=True),
    "combined": dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.7,
                     logit_bias={2: 3.0, 46: 1.0}, min_tokens=4, stop_token_ids=[3]),
}


@pytest.mark.parametrize("name", OPTIONS)
def test_processed_logits_equal_the_reference(name):
    prompt, output = [1, 2, 3, 2, 7], [2, 5, 5, 8, 1]
    seqs = [make_seq(str(i), prompt, output[:i], **OPTIONS[name]) for i in range(len(output) + 1)]
    logits = random_logits(len(seqs), seed=1)
    logits[:, 2] = -logits[:, 2].abs()  # a negative logit among the repeated tokens
    processed = sampler()._process_logits(logits, seqs)
    for i, seq in enumerate(seqs):
        expected = reference_logits(logits[i], prompt, output[:i], seq.sampling_params)
        torch.testing.assert_close(processed[i], expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(processed, logits)  # the option did something


@pytest.mark.parametrize("name", OPTIONS)
def test_greedy_picks_equal_the_reference_argmax(name):
    seqs = [make_seq(str(i), output=[2, 9, 9][:i], temperature=0.0, **OPTIONS[name]) for i in range(3)]
    logits = random_logits(3, seed=2)
    logits[:, 9] = logits.max() + 0.5  # the raw argmax is a repeated token
    logits[:, 46] = logits.max() + 0.25  # and eos is close
    out = sampler()(logits, seqs)
    expected = [reference_logits(logits[i], seq.prompt_token_ids, seq.output_token_ids,
                                 seq.sampling_params).argmax().item() for i, seq in enumerate(seqs)]
    assert out.token_ids == expected


def test_logit_bias_forces_a_token_and_logprobs_stay_raw():
    logits = random_logits(2, seed=3)
    seqs = [make_seq("g", temperature=0.0, logit_bias={17: 100.0}, logprobs=1),
            make_seq("s", seed=4, logit_bias={17: 100.0}, logprobs=1)]
    out = sampler()(logits, seqs)
    assert out.token_ids == [17, 17]
    raw = torch.log_softmax(logits, -1)
    for i in range(2):
        assert out.logprobs[i][17] == raw[i, 17].item()


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = random_logits(1, seed=5)[0]
    logits[46] = logits[11] = 50.0  # eos and a stop token dominate
    s = sampler()
    for num_out in range(5):
        seq = make_seq("m", output=[4] * num_out, temperature=0.0, min_tokens=3, stop_token_ids=[11])
        token = s(logits[None].clone(), [seq]).token_ids[0]
        assert (token in (46, 11)) == (num_out >= 3), (num_out, token)
    with_ignore = make_seq("i", temperature=0.0, min_tokens=3, stop_token_ids=[11], ignore_eos=True)
    assert s(logits[None].clone(), [with_ignore]).token_ids == [46]  # eos is no stop token with ignore_eos


def test_min_p_keeps_the_reference_support():
    logits = random_logits(1, seed=6, scale=1.5)
    support = reference_min_p_support(logits[0], 0.8, 0.2)
    assert 1 < len(support) < VOCAB // 2
    seqs = [make_seq(str(i), seed=i, temperature=0.8, min_p=0.2) for i in range(256)]
    tokens = sampler(256)(logits.expand(256, VOCAB).contiguous(), seqs).token_ids
    assert set(tokens) == support
    # With top-k on top: the k most likely of the survivors.
    seqs = [make_seq(str(i), seed=i, temperature=0.8, min_p=0.2, top_k=2) for i in range(256)]
    tokens = sampler(256)(logits.expand(256, VOCAB).contiguous(), seqs).token_ids
    assert set(tokens) == set(logits[0].topk(2).indices.tolist()) & support


def test_min_p_samples_follow_the_renormalised_distribution():
    logits = random_logits(1, seed=7, scale=1.0)[:, :8]
    probs = torch.softmax(logits[0].double() / 0.9, -1)
    kept = probs >= 0.5 * probs.max()
    expected = torch.where(kept, probs, 0.0) / probs[kept].sum()
    seqs = [make_seq(str(i), seed=i, temperature=0.9, min_p=0.5) for i in range(512)]
    tokens = torch.tensor(Sampler(512, "cpu", MAX_LEN)(logits.expand(512, 8).contiguous(), seqs).token_ids)
    counts = torch.bincount(tokens, minlength=8).double()
    assert 0.5 * (counts / counts.sum() - expected).abs().sum().item() < 0.05
    assert counts[~kept].sum() == 0


def run_steps(s: Sampler, seqs, logits_of, steps):
    for step in range(steps):
        out = s(logits_of(step), seqs)
        for seq, token in zip(seqs, out.token_ids, strict=True):
            seq.append_token(token)
    return [seq.output_token_ids for seq in seqs]


def test_each_request_samples_the_same_whatever_shares_its_batch():
    targets = {"pen": dict(repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.5, seed=11),
               "greedy-pen": dict(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0, seed=0),
               "bias-minp": dict(logit_bias={3: 2.0}, min_p=0.1, min_tokens=5, seed=12),
               "plain": dict(temperature=0.7, top_p=0.9, seed=13)}

    def logits_of(name, step):  # each request's logits depend on it and the step only
        return random_logits(1, seed=1000 * sorted(names).index(name) + step, scale=1.0)[0]

    names = [*targets, "noise-a", "noise-b"]
    alone = {name: run_steps(sampler(), [make_seq(name, **kw)], lambda st, n=name: logits_of(n, st)[None], 12)[0]
             for name, kw in targets.items()}
    kws = [*targets.values(), dict(seed=1, presence_penalty=2.0), dict(temperature=0.0)]
    crowd = [make_seq(n, **kw) for n, kw in zip(names, kws, strict=True)]
    together = run_steps(sampler(), crowd, lambda st: torch.stack([logits_of(n, st) for n in names]), 12)
    assert {n: together[i] for i, n in enumerate(targets)} == alone
    assert len(set(alone["pen"])) > 3  # it sampled


def test_a_batch_without_options_skips_the_processing(monkeypatch):
    s = sampler()

    def refuse(*args):
        raise AssertionError("the fast path ran the logits processing")

    monkeypatch.setattr(s, "_process_logits", refuse)
    seqs = [make_seq("a", temperature=0.0), make_seq("b", top_k=5), make_seq("c", repetition_penalty=1.0,
                                                                             presence_penalty=0.0, min_p=0.0)]
    s(random_logits(3), seqs)


# ---- the token history ------------------------------------------------------------------------
def reference_counts(seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    seen[seq.token_ids] = True
    counts = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.long), minlength=VOCAB).int()
    return seen, counts


def test_history_counts_with_rows_taken_back_and_rebuilt():
    history = TokenHistory(max_num_seqs=2, max_model_len=MAX_LEN, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(8)
    seqs = [make_seq(str(i), prompt=torch.randint(0, VOCAB, (3 + i,), generator=g).tolist()) for i in range(4)]
    for step in range(20):
        batch = [seqs[step % 4], seqs[(step + 1) % 4]]  # 4 requests over 2 rows: rows change owners
        seen, counts = history.counts(batch, VOCAB)
        for i, seq in enumerate(batch):
            ref_seen, ref_counts = reference_counts(seq)
            assert torch.equal(seen[i], ref_seen) and torch.equal(counts[i], ref_counts), (step, seq)
            seq.append_token(int(torch.randint(0, VOCAB, (), generator=g)))
    with pytest.raises(ValueError, match="in one batch"):
        history.counts(seqs[:3], VOCAB)
    history.rows.fill_(7)  # contents lost (e.g. a discarded tag): reset rebuilds the rows from the sequences
    history.reset()
    seen, counts = history.counts(seqs[:2], VOCAB)
    assert all(torch.equal(seen[i], reference_counts(seq)[0]) and torch.equal(counts[i], reference_counts(seq)[1])
               for i, seq in enumerate(seqs[:2]))


def test_history_limits():
    with pytest.raises(ValueError, match="no token history"):
        Sampler(2)(random_logits(1), [make_seq("p", repetition_penalty=1.2)])
    long_seq = make_seq("l", prompt=[1] * (MAX_LEN + 1), repetition_penalty=1.2)
    with pytest.raises(ValueError, match="more than the token history holds"):
        sampler()(random_logits(1), [long_seq])


def test_state_bytes_counts_every_buffer():
    s = Sampler(16, "cpu", 100, EOS)
    buffers = [s._inputs, s.history.rows]
    assert Sampler.state_bytes(16, 100) == sum(t.nbytes for t in buffers) == 16 * 5 * 8 + 16 * 100 * 4


# ---- end to end: LLM.generate on the tiny model -----------------------------------------------
ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=4, block_size=4)
PROMPTS = ["def greet(name):", [5, 6, 7, 5, 6, 7, 5, 6], "The quick brown fox"]


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    return LLM(tiny_model_path, **ENGINE)


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    return transformers.Qwen3ForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def prompt_ids(llm: LLM, prompt) -> list[int]:
    return llm.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)


def reference_greedy(hf, prompt: list[int], p: SamplingParams, eos: tuple[int, ...]) -> list[int]:
    """Greedy decoding over transformers' logits with `reference_logits` and the engine's stop rules."""
    output: list[int] = []
    while len(output) < p.max_tokens:
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + output])).logits[0, -1].float()
        token = reference_logits(logits, prompt, output, p, eos).argmax().item()
        output.append(token)
        if token in p.stop_token_ids or (not p.ignore_eos and token in eos):
            break
    return output


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 20, "ignore_eos": True, **kw})


E2E_OPTIONS = {
    "repetition": greedy(repetition_penalty=1.8),
    "frequency+presence": greedy(frequency_penalty=1.5, presence_penalty=0.8),
    "combined": greedy(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.5, min_tokens=6,
                       logit_bias={1023: 6.0, 7: 1.5}, stop_token_ids=[9], ignore_eos=False),
}


@pytest.mark.parametrize("name", E2E_OPTIONS)
def test_generate_equals_the_reference_over_transformers_logits(tiny, hf, name):
    params = E2E_OPTIONS[name]
    eos = tiny.engine.executor.driver.runner.model_config.eos_token_ids
    outputs = tiny.generate(PROMPTS, params)
    plain = tiny.generate(PROMPTS, greedy())
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(hf, prompt_ids(tiny, prompt), params, eos)
    assert [o.outputs[0].token_ids for o in outputs] != [o.outputs[0].token_ids for o in plain]


def test_repetition_penalty_equals_transformers_generate(tiny, hf):
    prompt = PROMPTS[1]
    out = tiny.generate([prompt], greedy(repetition_penalty=1.6))[0].outputs[0].token_ids
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, repetition_penalty=1.6,
                      eos_token_id=None, pad_token_id=0)
    assert out == ref[0, len(prompt):].tolist()
    assert out != tiny.generate([prompt], greedy())[0].outputs[0].token_ids


def test_logit_bias_forces_a_token(tiny):
    out = tiny.generate(PROMPTS[:1], greedy(max_tokens=8, logit_bias={321: 100}))[0].outputs[0]
    assert out.token_ids == [321] * 8
    seeded = SamplingParams(max_tokens=8, seed=5, logit_bias={321: 100}, ignore_eos=True)
    assert tiny.generate(PROMPTS[:1], seeded)[0].outputs[0].token_ids == [321] * 8


def test_min_tokens_delays_eos(tiny):
    eager = dict(logit_bias={1023: 100}, ignore_eos=False)  # eos is the argmax every step
    out = tiny.generate(PROMPTS[:1], greedy(**eager))[0].outputs[0]
    assert out.token_ids == [1023] and out.finish_reason == "stop"
    delayed = tiny.generate(PROMPTS[:1], greedy(min_tokens=5, **eager))[0].outputs[0]
    assert len(delayed.token_ids) == 6 and delayed.token_ids[-1] == 1023 and 1023 not in delayed.token_ids[:5]
    assert delayed.finish_reason == "stop"


def test_stop_token_ids_end_the_output_even_with_ignore_eos(tiny):
    out = tiny.generate(PROMPTS[:1], greedy(logit_bias={77: 100}, stop_token_ids=[77]))[0].outputs[0]
    assert out.token_ids == [77] and out.finish_reason == "stop" and out.stop_reason == 77
    held = tiny.generate(PROMPTS[:1], greedy(logit_bias={77: 100}, stop_token_ids=[77], min_tokens=3))[0].outputs[0]
    assert len(held.token_ids) == 4 and held.token_ids[-1] == 77 and held.stop_reason == 77


def test_skip_special_tokens(tiny):
    forced = dict(max_tokens=3, logit_bias={1023: 100})  # <|im_end|>, with ignore_eos
    assert tiny.generate(PROMPTS[:1], greedy(**forced))[0].outputs[0].text == ""
    kept = tiny.generate(PROMPTS[:1], greedy(skip_special_tokens=False, **forced))[0].outputs[0]
    assert kept.text == "<|im_end|>" * 3
    with_stop = greedy(skip_special_tokens=False, stop=["end|>"], **forced)
    assert tiny.generate(PROMPTS[:1], with_stop)[0].outputs[0].text == "<|im_"


def test_include_stop_str_in_output_and_min_tokens_with_stop_strings(tiny):
    full = tiny.generate(PROMPTS[:1], greedy(max_tokens=24))[0].outputs[0].text
    start = next(i for i in range(3, len(full) - 3) if full.index(full[i:i + 3]) == i)  # first occurrence
    stop = full[start:start + 3]
    cut = tiny.generate(PROMPTS[:1], greedy(max_tokens=24, stop=[stop]))[0].outputs[0]
    kept = tiny.generate(PROMPTS[:1], greedy(max_tokens=24, stop=[stop], include_stop_str_in_output=True))[0]
    assert cut.text == full[:start] and cut.finish_reason == "stop" and cut.stop_reason == stop
    assert kept.outputs[0].text == full[:start + 3] and kept.outputs[0].stop_reason == stop
    # Before min_tokens output tokens a stop string does not end the output.
    late = tiny.generate(PROMPTS[:1], greedy(max_tokens=24, stop=[stop], min_tokens=24))[0].outputs[0]
    assert late.text == full and late.finish_reason == "length"


def test_seeded_options_do_not_depend_on_the_batch(tiny):
    target = SamplingParams(max_tokens=16, seed=42, repetition_penalty=1.2, presence_penalty=0.5, min_p=0.05,
                            frequency_penalty=0.3, logit_bias={5: 1.0}, ignore_eos=True)
    alone = tiny.generate(PROMPTS[2:], target)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=12, seed=1, top_p=0.8, ignore_eos=True), greedy(max_tokens=5),
              SamplingParams(max_tokens=20, seed=2, frequency_penalty=2.0, ignore_eos=True)]
    batch = tiny.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[0]], [others[0], target, *others[1:]])
    assert batch[1].outputs[0].token_ids == alone


def test_bad_logit_bias_is_refused_and_the_engine_serves_on(tiny):
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 1024\)"):
        tiny.generate(PROMPTS, greedy(logit_bias={1024: 1.0}))
    assert tiny.engine.is_finished()
    assert len(tiny.generate(PROMPTS[:1], greedy(max_tokens=2))[0].outputs[0].token_ids) == 2


def streamed_text(llm: LLM, prompt, params: SamplingParams) -> tuple[str, RequestOutput]:
    """The concatenated text deltas of a streamed request, and its final output."""
    engine = llm.engine
    request_id = engine.add_request(prompt, params, stream=True)
    deltas, last = [], None
    while not engine.is_finished():
        for output in engine.step():
            if output.request_id == request_id:
                deltas.append(output.outputs[0].delta_text)
                last = output
    return "".join(deltas), last


@pytest.mark.parametrize("stops", [(), ("never",)])
def test_the_token_that_stops_the_output_adds_no_text(tiny, stops):
    """vLLM: the eos or stop_token_ids token that ends the output is in token_ids but its text is not in the
    text ("<|im_end|>" with skip_special_tokens=False, or an ordinary token named in stop_token_ids), unless
    include_stop_str_in_output; streamed or not."""
    tokenizer = tiny.tokenizer
    cases = {  # params -> the text of the token that stopped the output
        "stop_token_ids": (greedy(max_tokens=8, logit_bias={77: 100}, stop_token_ids=[77], min_tokens=3), "n"),
        "eos kept special": (greedy(max_tokens=8, logit_bias={1023: 100}, ignore_eos=False, min_tokens=2,
                                    skip_special_tokens=False), "<|im_end|>"),
    }
    for params, stop_text in cases.values():
        for keep in (False, True):
            p = SamplingParams(**{**{f: getattr(params, f) for f in params.__dataclass_fields__},
                                  "stop": stops, "include_stop_str_in_output": keep})
            out = tiny.generate(PROMPTS[:1], p)[0].outputs[0]
            assert out.finish_reason == "stop" and out.stop_reason in (77, None)
            before = tokenizer.decode(out.token_ids[:-1], skip_special_tokens=p.skip_special_tokens)
            assert out.text == (before + stop_text if keep else before), (p, out)
            text, last = streamed_text(tiny, PROMPTS[0], p)
            assert text == last.outputs[0].text == out.text


def test_out_of_vocab_stop_token_ids_are_refused_and_the_engine_serves_on(tiny):
    """min_tokens masks the stop tokens by index: an id beyond the vocabulary failed the whole step (every
    request in the batch; on CUDA a device-side assert) instead of refusing the one request."""
    with pytest.raises(ValueError, match=r"stop_token_ids .*\[0, 1024\).*\[1024\]") as refused:
        tiny.generate(PROMPTS[:1], greedy(max_tokens=4, min_tokens=2, stop_token_ids=[5, 1024]))
    assert refused.value.field == "stop_token_ids"
    assert tiny.engine.is_finished()
    assert len(tiny.generate(PROMPTS[:1], greedy(max_tokens=2))[0].outputs[0].token_ids) == 2


def test_history_lives_in_the_runtime_tag_and_survives_sleep(tiny_model_path):
    memory = MemoryManager("cpu")
    llm = LLM(tiny_model_path, memory=memory, **ENGINE)
    history = llm.engine.executor.driver.runner.sampler.history.rows
    segment = memory._backend.find(history.data_ptr())
    assert segment is not None and segment.tag == "runtime"
    params = [greedy(repetition_penalty=1.5, presence_penalty=1.0), SamplingParams(
        max_tokens=20, seed=3, frequency_penalty=1.0, ignore_eos=True)] * 2
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2] * 2, params)]
    for tag in memory.tags():
        memory.seal(tag)  # steps allocate nothing in a tag
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:2] * 2, params, strict=True)]
    for _ in range(6):
        engine.step()
    # Mid-request: offload the runtime state (the history), drop the KV cache, wake; the requests recompute.
    memory.sleep({"weights": "offload", "kv_cache": "discard", "runtime": "offload"})
    memory.wake()
    engine.scheduler.reset_blocks()
    done = {}
    while not engine.is_finished():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    assert [done[i] for i in ids] == expected
    assert memory.audit().late_allocations == ()
