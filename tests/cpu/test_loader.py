"""Config parsing and weight loading: in-place (re)loads, partial updates, and clear errors."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from torpor.engine.attention.torch_backend import TorchAttentionBackend
from torpor.engine.models import ModelConfig, build_model
from torpor.engine.weights.index import CheckpointError
from torpor.engine.weights.loader import iter_checkpoint, load_named_tensors, load_weights
from torpor.synthetic import make_model


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """Qwen2 geometry: qkv biases and tied embeddings."""
    return make_model("tiny-qwen2", tmp_path_factory.mktemp("qwen2"), progress=False)


def new_model(path, dtype=torch.float32):
    return build_model(ModelConfig.from_pretrained(path), TorchAttentionBackend(), dtype=dtype)


def checkpoint_tensors(path) -> dict[str, torch.Tensor]:
    return dict(iter_checkpoint(path))


def copy_checkpoint(src, dst, tensors: dict[str, torch.Tensor]):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_fused_and_plain_parameters_hold_the_checkpoint(qwen2):
    model = new_model(qwen2)
    load_weights(model, qwen2)
    tensors = checkpoint_tensors(qwen2)
    params = dict(model.named_parameters())
    attn = "model.layers.1.self_attn."
    q, k, v = (tensors[f"{attn}{p}_proj.weight"].float() for p in "qkv")
    assert torch.equal(params[attn + "qkv_proj.weight"], torch.cat([q, k, v]))
    bias = torch.cat([tensors[f"{attn}{p}_proj.bias"].float() for p in "qkv"])
    assert torch.equal(params[attn + "qkv_proj.bias"], bias)
    mlp = "model.layers.0.mlp."
    gate_up = torch.cat([tensors[mlp + "gate_proj.weight"], tensors[mlp + "up_proj.weight"]]).float()
    assert torch.equal(params[mlp + "gate_up_proj.weight"], gate_up)
    assert torch.equal(params["model.norm.weight"], tensors["model.norm.weight"].float())
    assert model.lm_head is None  # tied: the logits use the embedding table


def test_reload_restores_values_at_the_same_addresses(qwen2):
    model = new_model(qwen2, dtype=torch.bfloat16)
    load_weights(model, qwen2)
    tensors = [*model.parameters(), *model.buffers()]
    assert len(tensors) == len(list(model.parameters())) + 1  # the RoPE table
    before = [(t.data_ptr(), t.clone()) for t in tensors]
    with torch.no_grad():
        for t in tensors:
            t.zero_()  # what a discarded (level 2) sleep leaves behind
    load_weights(model, qwen2)
    for t, (address, value) in zip(tensors, before, strict=True):
        assert t.data_ptr() == address and torch.equal(t, value)


def test_partial_update_with_hf_names(qwen2):
    model = new_model(qwen2)
    load_weights(model, qwen2)
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    old = qkv.clone()
    config = model.config
    new_k = torch.full((config.kv_size, config.hidden_size), 0.5, dtype=torch.bfloat16)
    assert load_named_tensors(model, [("model.layers.0.self_attn.k_proj.weight", new_k)]) == 1
    k_rows = slice(config.q_size, config.q_size + config.kv_size)
    assert torch.equal(qkv[k_rows], new_k.float())
    assert torch.equal(qkv[: config.q_size], old[: config.q_size]) and torch.equal(
        qkv[k_rows.stop :], old[k_rows.stop :]
    )


def test_fp16_checkpoint_into_bf16_model(qwen2, tmp_path):
    tensors = {n: t.to(torch.float16) for n, t in checkpoint_tensors(qwen2).items()}
    path = copy_checkpoint(qwen2, tmp_path / "fp16", tensors)
    model = new_model(path, dtype=torch.bfloat16)
    load_weights(model, path)
    assert torch.equal(model.model.norm.weight, tensors["model.norm.weight"].to(torch.bfloat16))


def test_missing_files_are_named(qwen2, tmp_path):
    model = new_model(qwen2)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_weights(model, tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        load_weights(model, tmp_path)
    sharded = make_model("tiny-qwen2", tmp_path / "sharded", progress=False, max_shard_bytes=100_000)
    (sharded / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors: shard listed .* is missing"):
        load_weights(model, sharded)


def test_missing_unexpected_and_misshapen_tensors(qwen2, tmp_path):
    tensors = checkpoint_tensors(qwen2)
    model = new_model(qwen2)
    missing = {n: t for n, t in tensors.items() if n != "model.layers.1.self_attn.v_proj.bias"}
    with pytest.raises(ValueError, match=r"missing 1 tensors: model\.layers\.1\.self_attn\.v_proj\.bias"):
        load_weights(model, copy_checkpoint(qwen2, tmp_path / "missing", missing))
    extra = dict(tensors, **{"model.layers.0.mlp.extra_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.extra_proj\.weight' matches no parameter"):
        load_weights(model, copy_checkpoint(qwen2, tmp_path / "extra", extra))
    name = "model.layers.0.self_attn.q_proj.weight"
    bad = dict(tensors, **{name: tensors[name][:-1]})
    with pytest.raises(
        ValueError, match=rf"{name}.*shape mismatch: parameter has \(64, 64\), checkpoint has \(63, 64\)"
    ):
        load_weights(model, copy_checkpoint(qwen2, tmp_path / "shape", bad))
    with pytest.raises(ValueError, match=r"unsupported dtype torch\.int32"):
        load_named_tensors(model, [("model.norm.weight", torch.ones(64, dtype=torch.int32))])


def test_tied_head_and_rotary_buffers_in_checkpoints_are_ignored(qwen2, tmp_path):
    tensors = checkpoint_tensors(qwen2)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    model = new_model(qwen2)
    load_weights(model, copy_checkpoint(qwen2, tmp_path / "with_head", tensors))
    assert torch.equal(model.model.embed_tokens.weight, tensors["model.embed_tokens.weight"].float())


def test_config_errors(qwen2, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        ModelConfig.from_pretrained(tmp_path)
    config = json.loads((qwen2 / "config.json").read_text())
    for change, message in [
        ({"architectures": ["MistralForCausalLM"]}, "unsupported architecture 'MistralForCausalLM'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_scaling type 'yarn'"),
        ({"torch_dtype": "float8_e4m3fn"}, "unsupported torch_dtype"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"use_sliding_window": True}, "sliding-window"),
    ]:
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_dict(dict(config, **change))


# config.json values that crashed with KeyError/TypeError/ZeroDivisionError, built a model of negative or
# zero size, or a NaN rotary table: each a ValueError naming the file and the key.
BAD_CONFIGS = {
    "no heads": ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    "negative kv heads": ({"num_key_value_heads": -1}, "num_key_value_heads must be a positive integer"),
    "hidden size a string": ({"hidden_size": "64"}, "hidden_size must be a positive integer, got '64'"),
    "hidden size a float": ({"hidden_size": 64.0}, "hidden_size must be a positive integer, got 64.0"),
    "no hidden size": ({"hidden_size": None}, "hidden_size is missing"),
    "empty vocabulary": ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    "negative layers": ({"num_hidden_layers": -1}, "num_hidden_layers must be a positive integer"),
    "layers a bool": ({"num_hidden_layers": True}, "num_hidden_layers must be a positive integer"),
    "negative head_dim": ({"head_dim": -8}, "head_dim must be a positive integer"),
    "odd head_dim": ({"head_dim": 15}, "head_dim must be even"),
    "more heads than hidden": ({"num_attention_heads": 128, "num_key_value_heads": 2}, "head_dim must be a positive"),
    "negative positions": ({"max_position_embeddings": -1}, "max_position_embeddings must be a positive integer"),
    "rope theta 0": ({"rope_theta": 0}, "rope_theta must be a finite positive number"),
    "rope scaling a list": ({"rope_scaling": [1, 2]}, "rope_scaling must be an object"),
    "llama3 without factor": ({"rope_scaling": {"rope_type": "llama3", "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
                              "factor is missing"),
    "llama3 equal bands": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                                             "high_freq_factor": 2.0, "original_max_position_embeddings": 8192}},
                           "high_freq_factor .* must exceed low_freq_factor"),
    "eps a string": ({"rms_norm_eps": "x"}, "rms_norm_eps must be a finite non-negative number"),
    "torch_dtype a list": ({"torch_dtype": ["x"]}, "unsupported torch_dtype"),
    "architectures an object": ({"architectures": {"0": "LlamaForCausalLM"}}, "exactly one architecture"),
    "eos a string": ({"eos_token_id": "x"}, "eos_token_id must be a token id or a list of them"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_impossible_config_values_name_the_file_and_key(qwen2, tmp_path, case):
    change, message = BAD_CONFIGS[case]
    config = json.loads((qwen2 / "config.json").read_text())
    config = {k: v for k, v in {**config, **change}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"/config\.json: .*{message}"):
        ModelConfig.from_pretrained(tmp_path)


def test_config_and_generation_config_files_that_are_not_json_objects(qwen2, tmp_path):
    shutil.copy(qwen2 / "config.json", tmp_path / "config.json")
    for file in ("generation_config.json", "config.json"):
        for text, message in [("[1]", r"not a JSON object \(a list\)"), ("[" * 100_000, "nested too deeply"),
                              ('{"eos_token_id": [1, "x"]}', "eos_token_id must be a token id")]:
            if file == "config.json" and "eos" in text:
                continue
            (tmp_path / file).write_text(text)
            with pytest.raises(ValueError, match=rf"{file}: {message}"):
                ModelConfig.from_pretrained(tmp_path)
        (tmp_path / "generation_config.json").write_text("{}")


def test_config_of_each_architecture(tmp_path):
    qwen3 = ModelConfig.from_pretrained(make_model("tiny", tmp_path / "q3", progress=False))
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 32 and qwen3.q_size == 128
    assert qwen3.num_kv_groups == 2 and qwen3.tie_word_embeddings and qwen3.rope_scaling is None
    llama = ModelConfig.from_pretrained(make_model("tiny-llama", tmp_path / "ll", progress=False))
    assert not llama.qk_norm and not llama.qkv_bias and not llama.tie_word_embeddings
    assert llama.rope_scaling.factor == 8.0 and llama.rope_theta == 500000.0 and len(llama.eos_token_ids) == 3
    # transformers >= 5 writes rope parameters in one dict
    raw = json.loads((tmp_path / "ll" / "config.json").read_text())
    rope = dict(raw.pop("rope_scaling"), rope_theta=raw.pop("rope_theta"))
    assert ModelConfig.from_dict(dict(raw, rope_parameters=rope)) == llama


def test_checkpoint_tensors_stream_from_safetensors(qwen2):
    with safe_open(qwen2 / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert set(checkpoint_tensors(qwen2)) == names


def test_a_checked_update_copies_through_the_plans_as_the_weight_loaders_do(qwen2):
    """`copy_checked` (a whole checked update: the cached meta plans, no weight loader) writes exactly what the
    weight loaders write, tensor by tensor — fused q/k/v and gate/up, biases, tied embeddings — from sources that
    are views at an offset of one storage (a flattened bucket) or not contiguous at all, in another dtype."""
    from torpor.engine.weights.loader import check_update, copy_checked

    generator = torch.Generator().manual_seed(7)
    new = {name: torch.randn(t.shape, generator=generator).to(torch.bfloat16)
           for name, t in checkpoint_tensors(qwen2).items()}
    flat = torch.cat([t.reshape(-1) for t in new.values()])  # one storage, each tensor at its offset
    sources, offset = [], 0
    for i, (name, t) in enumerate(new.items()):
        view = flat[offset:offset + t.numel()].view(t.shape)
        offset += t.numel()
        if i % 3 == 0 and t.dim() == 2:  # the same values, transposed storage: not contiguous
            view = t.t().contiguous().t()
            assert not view.is_contiguous()
        sources.append((name, view))
    by_loaders, by_plans = new_model(qwen2), new_model(qwen2)
    load_weights(by_loaders, qwen2)
    load_weights(by_plans, qwen2)
    assert load_named_tensors(by_loaders, list(new.items())) == load_named_tensors(by_plans, sources,
                                                                                   values_checked=True)
    check_update(by_plans, sources, strict=True)  # what values_checked stands for
    assert copy_checked(by_plans, sources) > 0  # again, from the cache
    expected = dict(by_loaders.named_parameters())
    for name, param in by_plans.named_parameters():
        assert torch.equal(param, expected[name]), name
    assert not torch.equal(expected["model.norm.weight"], checkpoint_tensors(qwen2)["model.norm.weight"].float())


def test_a_checked_copy_that_fails_midway_says_the_weights_are_a_mix(qwen2):
    """`copy_checked` after its checks can fail only on the device (here a source whose data cannot be read): before
    any write the error is raised as it is (the weights are as they were); after one, as CheckpointError with
    `weights_written`, which makes the engine refuse to serve until a complete update."""
    from torpor.engine.weights.loader import copy_checked

    model = new_model(qwen2)
    load_weights(model, qwen2)
    norm, k = "model.norm.weight", "model.layers.0.self_attn.k_proj.weight"
    config = model.config
    unreadable = torch.empty(config.kv_size, config.hidden_size, device="meta")
    with pytest.raises((RuntimeError, NotImplementedError)) as first:
        copy_checked(model, [(k, unreadable)])
    assert not isinstance(first.value, CheckpointError)
    with pytest.raises(CheckpointError, match="after writing 1 tensors") as midway:
        copy_checked(model, [(norm, torch.ones(config.hidden_size)), (k, unreadable)])
    assert midway.value.weights_written
    assert torch.equal(dict(model.named_parameters())[norm], torch.ones(config.hidden_size))
