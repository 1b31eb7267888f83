"""Qwen3-MoE on CPU (fp32): against transformers (the synthetic tiny-moe checkpoint, and a model built and saved by
transformers' own Qwen3MoeForCausalLM), routed experts equal to transformers' router choices, the config's sparse
layers, per-expert and fused weight names through every load path (checked before any byte is written), the
bit-exact sleep/wake harness, prefix caching on vs off, tensor parallelism and dummy weights."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import transformers

from torpor.engine import LLM, SamplingParams
from torpor.engine.models import ModelConfig
from torpor.engine.weights.index import CheckpointError
from torpor.engine.weights.loader import check_update, iter_checkpoint
from torpor.rl import WeightPusher
from torpor.synthetic import make_model
from torpor.testing.harness import differences, fixed_requests, run_harness, run_round

ENGINE = dict(device="cpu", dtype="float32", max_model_len=96, max_num_seqs=8, block_size=8)
ATOL = 1e-4


@pytest.fixture(scope="module")
def llm(tiny_moe_path):
    return LLM(tiny_moe_path, **ENGINE)


@pytest.fixture(autouse=True)
def awake(request):
    """Every test starts from an awake engine with the checkpoint's weights (a test that changes them restores)."""
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm")
        if engine.is_sleeping():
            engine.wake_up()
        if engine.engine.lifecycle.weights_discarded:
            engine.reload_weights()


@pytest.fixture(scope="module")
def seed1_path(tmp_path_factory) -> str:
    """tiny-moe with other weights: what a trainer pushes."""
    return str(make_model("tiny-moe", tmp_path_factory.mktemp("moe-seed1") / "tiny-moe", seed=1, dtype="float32",
                          progress=False))


@pytest.fixture(scope="module")
def hf_built(tmp_path_factory):
    """transformers' own Qwen3MoeForCausalLM (4 layers, 16 experts, top 4, no renormalisation), random weights of
    order one, written by `save_pretrained` (safetensors, per-expert names). The tokenizer is tiny-moe's."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=False, max_position_embeddings=512, tie_word_embeddings=False, experts_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.05 * torch.randn_like(param))
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5)
    path = tmp_path_factory.mktemp("hf-moe") / "hf-moe"
    model.save_pretrained(path)
    return str(path), model


def reference(path: str):
    """transformers' model of `path`, fp32, its eager attention and its loop over the experts (the reference
    semantics; its default grouped_mm is ten times slower on CPU)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                             experts_implementation="eager").eval()


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]


def answers(llm, prompts=((1, 2, 3, 4), (7, 8, 9))) -> list:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1, return_routed_experts=True)
    return [(c.token_ids, c.logprobs, c.routed_experts.tolist())
            for o in llm.generate([list(p) for p in prompts], params) for c in o.outputs]


def check_against_transformers(llm, model, prompts: list[list[int]]) -> None:
    """Greedy and seeded-sampled completions: every prompt and output logprob within ATOL of transformers' over
    the same tokens, greedy tokens its argmax at every step, routed experts its router's top-k (in order)."""
    top_k = llm.engine.executor.driver.runner.model_config.num_experts_per_tok
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0, prompt_logprobs=0,
                            return_routed_experts=True)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, logprobs=0,
                             return_routed_experts=True)
    outputs = llm.generate(prompts + prompts, [greedy] * len(prompts) + [sampled] * len(prompts))
    for i, out in enumerate(outputs):
        prompt, completion = out.prompt_token_ids, out.outputs[0]
        tokens = prompt + completion.token_ids
        with torch.inference_mode():
            result = model(torch.tensor([tokens[:-1]]), output_router_logits=True)
        logprobs = torch.log_softmax(result.logits[0].float(), dim=-1)  # row p predicts token p + 1
        first = len(prompt) - 1
        for j, token in enumerate(completion.token_ids):
            assert completion.logprobs[j][token].logprob == pytest.approx(logprobs[first + j, token].item(), abs=ATOL)
            if i < len(prompts):
                assert token == logprobs[first + j].argmax().item(), f"greedy token {j} of prompt {i}"
        if out.prompt_logprobs is not None:
            for p in range(1, len(prompt)):
                assert out.prompt_logprobs[p][prompt[p]].logprob == pytest.approx(logprobs[p - 1, prompt[p]].item(),
                                                                                   abs=ATOL)
        chosen = np.stack([torch.topk(torch.softmax(layer.float(), -1), top_k, -1).indices.numpy()
                           for layer in result.router_logits], axis=1)  # [positions, sparse layers, k]
        assert completion.routed_experts.dtype == np.int16
        assert np.array_equal(completion.routed_experts, chosen[first:])


# ---- against transformers -----------------------------------------------------------------------------
def test_tiny_moe_matches_transformers(llm, tiny_moe_path):
    check_against_transformers(llm, reference(tiny_moe_path), random_prompts([5, 17, 30], seed=1))


def test_a_model_saved_by_transformers_matches_it(hf_built, tiny_moe_path):
    path, model = hf_built
    config = ModelConfig.from_pretrained(path)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_layers) == (16, 4, (0, 1, 2, 3))
    assert not config.norm_topk_prob
    engine = LLM(path, tokenizer=tiny_moe_path, **ENGINE)
    check_against_transformers(engine, model, random_prompts([3, 12, 40], seed=2))


def test_the_sparse_layers_are_transformers_choice():
    """decoder_sparse_step and mlp_only_layers pick the same layers as transformers' Qwen3MoeDecoderLayer."""
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                         num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=1,
                                         num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2,
                                         mlp_only_layers=[3])
    model = transformers.Qwen3MoeForCausalLM(config)
    sparse = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    parsed = ModelConfig.from_dict({**json.loads(config.to_json_string()), "architectures": ["Qwen3MoeForCausalLM"]})
    assert parsed.moe_layers == sparse == (1, 5)


@pytest.mark.parametrize(("change", "message"), [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok .9. exceeds num_experts .8."),
    ({"mlp_only_layers": [3]}, r"mlp_only_layers must be a list of layer indices in \[0, 3\)"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size must be a positive integer"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
])
def test_bad_moe_configs_name_the_key(tiny_moe_path, change, message):
    with open(f"{tiny_moe_path}/config.json") as f:
        config = json.load(f)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**config, **change})


# ---- routed experts ------------------------------------------------------------------------------------
def test_routed_experts_of_n_samples_and_streams(llm):
    """One row per output token for every sample, the same for a streamed request's final output, and none for a
    request that did not ask."""
    prompt = random_prompts([9], seed=3)[0]
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=6, ignore_eos=True, return_routed_experts=True)
    (out,) = llm.generate([prompt], params)
    config = llm.engine.executor.driver.runner.model_config
    for c in out.outputs:
        assert c.routed_experts.shape == (6, len(config.moe_layers), config.num_experts_per_tok)
        assert ((c.routed_experts >= 0) & (c.routed_experts < config.num_experts)).all()
        assert all(len(set(row)) == config.num_experts_per_tok for row in c.routed_experts.reshape(-1, 2).tolist())
    assert np.array_equal(out.outputs[0].routed_experts[0], out.outputs[1].routed_experts[0])  # one shared prefill
    engine = llm.engine
    request_id = engine.add_request(prompt, params, stream=True)
    streamed = []
    while engine.has_work():
        streamed += [o for o in engine.step() if o.request_id == request_id]
    final = streamed[-1]
    assert [np.array_equal(a.routed_experts, b.routed_experts) for a, b in zip(final.outputs, out.outputs,
                                                                                  strict=True)] == [True] * 3
    deltas = np.concatenate([s.outputs[0].delta_routed_experts for s in streamed])
    assert np.array_equal(deltas, final.outputs[0].routed_experts)
    (plain,) = llm.generate([prompt], dataclasses.replace(params, return_routed_experts=False))
    assert all(c.routed_experts is None for c in plain.outputs)


def test_routed_experts_are_refused_for_a_dense_model(tiny_model_path):
    dense = LLM(tiny_model_path, device="cpu", max_model_len=64, max_num_seqs=2)
    with pytest.raises(ValueError, match="return_routed_experts needs a mixture-of-experts model"):
        dense.generate([[1, 2]], SamplingParams(max_tokens=2, return_routed_experts=True))


# ---- weights: names, checks, updates -------------------------------------------------------------------
def test_the_30b_preset_checkpoint_covers_its_model_exactly():
    """qwen3-30b-a3b's geometry (built on the meta device, nothing allocated): every one of its 18867 checkpoint
    tensors plans onto a parameter, and they cover every parameter and shard (the generator writes these names)."""
    from torpor.engine.attention.torch_backend import TorchAttentionBackend
    from torpor.engine.models import build_model
    from torpor.engine.weights.loader import plan_copies
    from torpor.engine.weights.manifest import weight_specs
    from torpor.synthetic import get_preset, preset_bytes
    from torpor.synthetic.generator import config_json

    config = ModelConfig.from_dict(config_json(get_preset("qwen3-30b-a3b"), "bfloat16"))
    assert (config.num_hidden_layers, config.hidden_size, config.num_experts, config.num_experts_per_tok,
            config.moe_intermediate_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.vocab_size, config.norm_topk_prob, config.rope_theta, config.max_position_embeddings) == \
        (48, 2048, 128, 8, 768, 32, 4, 128, 151936, True, 1e6, 40960)
    model = build_model(config, TorchAttentionBackend(), device="meta", max_model_len=64)
    specs = weight_specs(config)
    copies = plan_copies(model, ((name, shape, torch.bfloat16) for name, shape in specs), strict=True)
    assert len(copies) == len(specs) == 18867
    assert sum(p.numel() for p in model.parameters()) * 2 == preset_bytes("qwen3-30b-a3b") == 61_064_245_248


def test_checkpoint_names_are_per_expert(tiny_moe_path):
    names = {name for name, _ in iter_checkpoint(tiny_moe_path)}
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names and "model.layers.2.mlp.gate.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names  # the dense layer
    assert not any(".experts.gate_up_proj" in name for name in names)


def test_bad_expert_tensors_are_refused_before_any_byte_is_written(llm, tiny_moe_path):
    model = llm.engine.executor.driver.runner.model
    named = list(iter_checkpoint(tiny_moe_path))
    before = answers(llm)
    up = dict(named)["model.layers.0.mlp.experts.3.up_proj.weight"]
    cases = [
        ([("model.layers.0.mlp.experts.8.up_proj.weight", up)], "expert 8 does not exist"),
        ([("model.layers.0.mlp.experts.03.up_proj.weight", up)], "matches no parameter"),
        ([("model.layers.1.mlp.experts.0.up_proj.weight", up)], "matches no parameter"),  # the dense layer
        ([("model.layers.0.mlp.experts.3.up_proj.weight", up[:, :-1])], "shape mismatch"),
        ([("model.layers.0.mlp.experts.gate_up_proj", up)], "fused gate_up_proj must be"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            check_update(model, bad, strict=False)
        # A good tensor first: nothing of it is written either (the engine checks the checkpoint's manifest, then the
        # model's loaders: either refuses the whole update).
        with pytest.raises(ValueError, match=f"{message}|weight update refused, nothing was written"):
            llm.update_weights([(n, t * 2) for n, t in named[:5]] + bad)
    missing = [(n, t) for n, t in named if n != "model.layers.2.mlp.experts.5.gate_proj.weight"]
    with pytest.raises(ValueError, match=r"missing 1 tensors: model\.layers\.2\.mlp\.experts\.5\.gate_proj\.weight"):
        check_update(model, missing, strict=True)
    assert answers(llm) == before


def test_a_checkpoint_missing_an_expert_names_it(tmp_path, tiny_moe_path):
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(tiny_moe_path, tmp_path / "broken", ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {n: t for n, t in iter_checkpoint(tiny_moe_path) if n != "model.layers.0.mlp.experts.6.down_proj.weight"}
    save_file(tensors, str(tmp_path / "broken" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.experts\.6\.down_proj\.weight"):
        LLM(str(tmp_path / "broken"), **ENGINE)


def test_update_one_expert_then_restore(llm, tiny_moe_path):
    before = answers(llm)
    name = "model.layers.0.mlp.experts.2.down_proj.weight"
    original = dict(iter_checkpoint(tiny_moe_path))[name]
    experts = llm.engine.executor.driver.runner.model.model.layers[0].mlp.experts
    assert llm.update_weights([(name, original * 3)]) == 1
    assert torch.equal(experts.down_proj[2], original * 3) and torch.equal(experts.down_proj[1], experts.down_proj[1])
    llm.update_weights([(name, original)])
    assert answers(llm) == before


def test_a_transformers_trainers_fused_parameters_load(llm, seed1_path, tiny_moe_path):
    """transformers >= 5 holds the experts fused ([E, 2I, H], [E, H, I]): its named_parameters() load as they are,
    by update_weights and by SGLang's update_weights_from_tensor (a fused tensor counts for every expert's names
    in the tensors a level-2 sleep waits for)."""
    expected, before = answers(LLM(seed1_path, **ENGINE)), answers(llm)
    trainer = reference(seed1_path)
    named = [(n, p.detach()) for n, p in trainer.named_parameters()]
    assert dict(named)["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 96, 64)
    llm.sleep(2)
    llm.wake_up()
    llm.update_weights(named)  # all of them: level 2 needs all
    assert answers(llm) == expected
    llm.sleep(2)
    llm.wake_up(["weights"])
    half = len(named) // 2
    llm.update_weights_from_tensor(named[:half])
    assert not llm.engine.serving  # half a model
    llm.update_weights_from_tensor(named[half:])
    llm.wake_up()
    assert answers(llm) == expected
    llm.update_weights_from_tensor([(n, p.detach()) for n, p in reference(tiny_moe_path).named_parameters()])
    assert answers(llm) == before


def test_flattened_bucket_and_sglang_pushes_with_per_expert_names(llm, seed1_path, tiny_moe_path):
    expected, before = answers(LLM(seed1_path, **ENGINE)), answers(llm)
    llm.sleep(2)
    llm.wake_up(["weights"])
    report = WeightPusher(llm, bucket_bytes=60_000).push(iter_checkpoint(seed1_path))
    assert report.buckets > 3
    llm.wake_up()
    assert answers(llm) == expected
    llm.update_weights_from_tensor(list(iter_checkpoint(tiny_moe_path)))  # SGLang's call, in process
    assert answers(llm) == before


# ---- what torpor promises ------------------------------------------------------------------------------
def test_bit_exact_after_every_kind_of_sleep_and_wake(llm):
    requests = [(p, dataclasses.replace(sp, return_routed_experts=True))
                for p, sp in fixed_requests(6, llm.engine.vocab_size, max_prompt=24, max_tokens=6)]
    results = run_harness(llm, requests, log=lambda line: None)
    assert [(r.name, r.mismatches) for r in results] == [(r.name, 0) for r in results]
    assert not differences(run_round(llm, requests), run_round(llm, requests))


def test_prefix_caching_on_or_off_gives_the_same_bits(llm, tiny_moe_path):
    uncached = LLM(tiny_moe_path, enable_prefix_caching=False, **ENGINE)
    head = random_prompts([40], seed=6)[0]
    prompts = [head + tail for tail in random_prompts([1, 6, 13], seed=7)]
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=6, ignore_eos=True, logprobs=2,
                            return_routed_experts=True)
    llm.reset_prefix_cache()
    llm.generate(prompts, params)  # caches the head's blocks
    cached = llm.generate(prompts, params)
    assert [o.num_cached_tokens for o in cached] == [40, 40, 48]
    plain = uncached.generate(prompts, params)
    assert not differences(plain, cached)


def test_tensor_parallel_matches_one_rank(tiny_moe_path, seed1_path, llm):
    """Experts sharded along their intermediate dimension over two CPU processes (gloo); each rank slices what it
    is sent, per-expert or fused tensors."""
    prompts = random_prompts([4, 19], seed=8)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1, return_routed_experts=True)
    expected = llm.generate(prompts, params)
    greedy = dataclasses.replace(params, logprobs=None, return_routed_experts=False)
    seed1 = [o.outputs[0].token_ids for o in LLM(seed1_path, **ENGINE).generate(prompts, greedy)]
    trainer = [(n, p.detach()) for n, p in reference(seed1_path).named_parameters()]
    tp = LLM(tiny_moe_path, tensor_parallel_size=2, **ENGINE)
    try:
        got = tp.generate(prompts, params)
        for a, b in zip(expected, got, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert np.array_equal(a.outputs[0].routed_experts, b.outputs[0].routed_experts)
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                assert all(x[t].logprob == pytest.approx(y[t].logprob, abs=ATOL) for t in x)
        tp.update_weights(trainer)  # the experts fused
        assert [o.outputs[0].token_ids for o in tp.generate(prompts, greedy)] == seed1
    finally:
        tp.close()


def test_dummy_weights_need_no_checkpoint_and_reload_bit_exact(tmp_path, capsys):
    from torpor.cli.main import main

    path = str(tmp_path / "config-only")
    assert main(["make-model", "tiny-moe", path, "--dtype", "float32", "--config-only"]) == 0
    assert sorted(p.name for p in (tmp_path / "config-only").iterdir()) == [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        LLM(path, **ENGINE)
    engine = LLM(path, load_format="dummy", **ENGINE)
    before = answers(engine)
    engine.sleep(2)
    engine.wake_up()
    engine.reload_weights()
    assert answers(engine) == before
    assert answers(LLM(path, load_format="dummy", seed=1, **ENGINE)) != before  # another seed, other weights


def test_dummy_weights_take_a_trainers_weights_by_name(tmp_path, tiny_moe_path, seed1_path, llm):
    """vLLM's RL start: an engine on dummy weights, then the trainer's tensors (per-expert names) — it then answers
    as an engine on that checkpoint; after a level-2 sleep it names the checkpoint's tensors still missing."""
    from torpor.cli.main import main

    path = str(tmp_path / "config-only")
    assert main(["make-model", "tiny-moe", path, "--dtype", "float32", "--config-only"]) == 0
    engine = LLM(path, load_format="dummy", **ENGINE)
    assert answers(engine) != answers(llm)
    with pytest.raises(ValueError, match=r"unknown tensor 'model\.layers\.0\.mlp\.experts\.99\.up_proj\.weight'"):
        engine.update_weights([("model.layers.0.mlp.experts.99.up_proj.weight", torch.zeros(1))])
    assert engine.update_weights(iter_checkpoint(tiny_moe_path)) > 0
    assert answers(engine) == answers(llm)
    engine.sleep(2)
    engine.wake_up()
    missing = r"\(80 tensors not written since: lm_head\.weight, model\.embed_tokens\.weight"
    with pytest.raises(RuntimeError, match=missing):
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    engine.update_weights(iter_checkpoint(seed1_path))
    assert answers(engine) == answers(LLM(seed1_path, **ENGINE))
