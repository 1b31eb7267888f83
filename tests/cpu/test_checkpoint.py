"""Synthetic checkpoints: layout, determinism, sharding, real geometries, tokenizer and chat template."""

import json
import math
import threading

import pytest
import torch

from torpor.engine.attention.metadata import AttentionMetadata
from torpor.engine.attention.torch_backend import TorchAttentionBackend
from torpor.engine.models import ModelConfig, build_model
from torpor.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from torpor.engine.weights.loader import load_weights
from torpor.engine.weights.manifest import weight_specs
from torpor.synthetic import PRESETS, default_model_path, make_model
from torpor.synthetic.generator import config_json, plan_shards
from torpor.synthetic.tokenizer_builder import build_tokenizer, special_token_ids

HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("tiny"), progress=False)


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path, tiny):
    again = make_model("tiny", tmp_path / "again", progress=False)
    other = make_model("tiny", tmp_path / "other", seed=1, progress=False)
    names = sorted(p.name for p in tiny.iterdir())
    assert names == sorted([*HF_FILES, "model.safetensors"])
    for name in names:
        assert (tiny / name).read_bytes() == (again / name).read_bytes(), name
    assert (tiny / "config.json").read_bytes() == (other / "config.json").read_bytes()
    assert (tiny / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_sharded_checkpoint_has_index_and_loads_like_single_file(tmp_path):
    single = make_model("tiny-llama", tmp_path / "single", dtype="float32", progress=False)
    sharded = make_model("tiny-llama", tmp_path / "sharded", dtype="float32", progress=False, max_shard_bytes=200_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n >= 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (sharded / "model.safetensors").exists()
    config = ModelConfig.from_pretrained(sharded)
    specs = weight_specs(config)
    assert sorted(index["weight_map"]) == sorted(name for name, _ in specs)
    assert index["metadata"]["total_size"] == sum(math.prod(shape) * 4 for _, shape in specs)
    models = []
    for path in (single, sharded):
        model = build_model(config, TorchAttentionBackend(), dtype=torch.float32)
        load_weights(model, path)
        models.append(model.state_dict())
    assert models[0].keys() == models[1].keys()
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])
    import transformers
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(sharded, output_loading_info=True)
    assert not any(info.values()), info  # no missing / unexpected / mismatched tensors
    assert torch.equal(hf.model.layers[1].mlp.up_proj.weight, models[1]["model.layers.1.mlp.gate_up_proj.weight"][160:])
    make_model("tiny-llama", sharded, dtype="float32", progress=False)  # rewritten unsharded: no stale shards
    assert sorted(p.name for p in sharded.iterdir()) == sorted(p.name for p in single.iterdir())


@pytest.mark.parametrize(
    ("preset", "num_params", "num_shards"),
    [("qwen3-0.6b", 596_049_920, 1), ("qwen3-8b", 8_190_735_360, 4), ("llama-3.1-8b", 8_030_261_248, 4),
     ("qwen2.5-1.5b", 1_543_714_304, 1), ("qwen3-30b-a3b", 30_532_122_624, 13)],
)  # fmt: skip
def test_real_presets_have_published_parameter_counts(preset, num_params, num_shards):
    config = ModelConfig.from_dict(config_json(PRESETS[preset], "bfloat16"))
    specs = weight_specs(config)
    assert sum(math.prod(shape) for _, shape in specs) == num_params
    shards = plan_shards(specs, torch.bfloat16, 5 * 10**9)
    assert len(shards) == num_shards
    assert all(sum(math.prod(s) * 2 for _, s in shard) <= 5 * 10**9 for shard in shards)
    assert max(config.eos_token_ids) < config.vocab_size


def test_tiny_logits_finite_and_spread_in_bf16(tiny):
    config = ModelConfig.from_pretrained(tiny)
    assert config.torch_dtype == torch.bfloat16
    model = build_model(config, TorchAttentionBackend())
    load_weights(model, tiny)
    ids = Tokenizer.from_pretrained(tiny).encode("The dormouse sleeps through the winter.")
    n = len(ids)
    lens = torch.tensor([n], dtype=torch.int32)
    metadata = AttentionMetadata(True, torch.arange(n), lens, torch.zeros(1, 1, dtype=torch.int32),
                                 torch.tensor([0, n], dtype=torch.int32), n, n)  # fmt: skip
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids), torch.arange(n), metadata))
    assert logits.dtype == torch.float32 and logits.isfinite().all()
    assert logits.std(dim=-1).min() > 0.3 and logits.std(dim=-1).max() < 10
    assert len(set(logits.argmax(-1).tolist())) > 1  # not the same prediction everywhere


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_tokenizer_round_trip_and_unknown_ids(tmp_path, preset):
    tokenizer = Tokenizer.from_pretrained(make_model(preset, tmp_path, progress=False))
    text = "Hello wörld: the dormouse sleeps 42 nights — 日本語 ok?\n  indented"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # BPE merges learnt something
    with_special = tokenizer.encode(text)
    assert with_special[0] == tokenizer.bos_token_id if tokenizer.bos_token else with_special == ids
    pieces = IncrementalDetokenizer(tokenizer)
    assert "".join(pieces.step(i) for i in ids) == text
    assert tokenizer.decode([*ids[:2], 100_000, 5000, *ids[2:4]]) == (
        tokenizer.decode(ids[:2]) + "<unk_100000><unk_5000>" + tokenizer.decode(ids[2:4])
    )


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "llama-3.1-8b"])
def test_real_geometry_tokenizers_decode_every_id_to_words(tmp_path, preset):
    """A synthetic model samples every id of its vocabulary: each decodes to readable (meaningless) text, the
    same on every build, while text still encodes with the corpus's merges and the special ids stay put."""
    spec = PRESETS[preset]
    built = build_tokenizer(spec)
    assert built.to_str() == build_tokenizer(spec).to_str()  # deterministic
    (tmp_path / "tokenizer.json").write_text(built.to_str())
    tokenizer = Tokenizer.from_pretrained(tmp_path)
    vocab = spec.config["vocab_size"]
    assert tokenizer.vocab_size == vocab and built.get_vocab_size() == vocab  # no id left to <unk_ID>
    specials = set(special_token_ids(spec).values())
    ids = [i for i in range(0, vocab, 7) if i not in specials]
    text = tokenizer.decode(ids)
    assert "<unk_" not in text and "\ufffd" not in text[2000:]  # (byte pieces of the corpus come first)
    words = text[2000:].split()
    assert len(words) > len(ids) / 3 and sum(w.isalpha() and w.isascii() for w in words) > 0.95 * len(words)
    assert tokenizer.decode(tokenizer.encode("Hello, the dormouse sleeps.", add_special_tokens=False)) == (
        "Hello, the dormouse sleeps.")
    assert len(tokenizer.encode("the dormouse sleeps", add_special_tokens=False)) <= 5  # learnt merges only


def test_special_tokens_keep_real_ids():
    tokenizer = build_tokenizer(PRESETS["llama-3.1-8b"])
    assert tokenizer.token_to_id("<|begin_of_text|>") == 128000
    assert tokenizer.token_to_id("<|eot_id|>") == 128009
    assert tokenizer.encode("<|start_header_id|>user").ids[:2] == [128000, 128006]


def test_chat_template_matches_transformers(tiny):
    import transformers
    ours = Tokenizer.from_pretrained(tiny)
    theirs = transformers.AutoTokenizer.from_pretrained(tiny)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    for add_generation_prompt in (True, False):
        text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    text = ours.apply_chat_template(messages)
    assert text.endswith("<|im_start|>assistant\n") and "Why is the sky blue?" in text
    ids = ours.apply_chat_template(messages, tokenize=True)
    assert ids.count(ours.eos_token_id) == 2 and ours.decode(ids, skip_special_tokens=False) == text


def test_missing_chat_template_is_a_clear_error(tiny, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_pretrained(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")


def test_default_model_path_generates_once_even_concurrently(tmp_path, monkeypatch, tiny):
    monkeypatch.setenv("TORPOR_CACHE", str(tmp_path))
    results, errors = [], []

    def call():
        try:
            results.append(default_model_path())
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    path = results[0]
    assert path.is_relative_to(tmp_path / "models")
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary directory left
    assert (path / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_path() == path and (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_unknown_preset_and_dtype(tmp_path):
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        make_model("nope", tmp_path, progress=False)
    with pytest.raises(ValueError, match="unsupported dtype"):
        make_model("tiny", tmp_path, dtype="int8", progress=False)
