"""A failed reload or update never leaves a mix of old and new weights being served:
every header and every tensor of a list is checked before a byte is written; a stream that fails midway,
or non-finite values found after the copy, make the engine refuse to serve until a complete reload."""

import shutil

import pytest
import torch
from safetensors.torch import save_file

from torpor.engine import LLM, SamplingParams
from torpor.engine.weights.index import CheckpointError
from torpor.engine.weights.loader import iter_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [5, 6, 7]]
OPTIONS = dict(device="cpu", max_num_seqs=4, max_model_len=64)


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(tiny_model_path, **OPTIONS)


@pytest.fixture(scope="module")
def reference(llm):
    return outputs(llm)


def outputs(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def scaled_checkpoint(src, dst, change) -> str:
    """`src` with every weight ×1.5, then `change(tensors)` applied: a checkpoint that is wrong only at the end."""
    tensors = {n: t * 1.5 for n, t in iter_checkpoint(src)}
    change(tensors)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


LAST = "model.norm.weight"
BAD_CHECKPOINTS = {
    "wrong shape": (lambda t: t.update({LAST: t[LAST][:-1]}), "shape mismatch"),
    "missing": (lambda t: t.pop(LAST), "missing 1 tensors: model.norm.weight"),
    "int32": (lambda t: t.update({LAST: t[LAST].to(torch.int32)}), "unsupported dtype torch.int32"),
    "extra": (lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.ones(2, 2)}), "matches no parameter"),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_bad_reload_leaves_the_weights_untouched(llm, reference, tiny_model_path, tmp_path, case):
    change, message = BAD_CHECKPOINTS[case]
    path = scaled_checkpoint(tiny_model_path, tmp_path / "bad", change)
    model = llm.engine.executor.driver.runner.model
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match=message):
        llm.reload_weights(path)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert outputs(llm) == reference


def test_good_scaled_checkpoint_does_change_the_answers(llm, reference, tiny_model_path, tmp_path):
    """The control for the test above: the ×1.5 weights do reach the model when nothing is wrong."""
    llm.reload_weights(scaled_checkpoint(tiny_model_path, tmp_path / "good", lambda t: None))
    assert outputs(llm) != reference
    llm.reload_weights()
    assert outputs(llm) == reference


def test_bad_update_list_writes_nothing(llm, reference):
    good = dict(iter_checkpoint(llm.config.model))
    halved = good["model.norm.weight"] * 0.5
    for bad, message in [
        (("model.embed_tokens.weight", torch.ones(3, 3)), "has shape"),
        (("model.embed_tokens.weight", torch.full_like(good["model.embed_tokens.weight"], float("inf"))),
         "non-finite"),
        (("model.nothing.weight", torch.ones(3)), "unknown tensor 'model.nothing.weight'"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.update_weights([("model.norm.weight", halved), bad])
        assert outputs(llm) == reference


def test_stream_failing_midway_stops_serving_until_a_reload(llm, reference):
    good = list(iter_checkpoint(llm.config.model))

    def stream():
        yield good[0][0], good[0][1] * 2
        yield "model.embed_tokens.weight", torch.ones(3, 3)

    with pytest.raises(CheckpointError, match=r"failed after writing 1 tensors.*shape mismatch"):
        llm.update_weights(stream())
    with pytest.raises(RuntimeError, match="reload_weights"):  # at once: no hang, no mixed answers
        llm.generate(PROMPTS, GREEDY)
    assert llm.memory_usage()["weights_discarded"]
    llm.update_weights(iter([good[0]]))  # after a mix only a complete update (or a reload) will do
    assert not llm.state.serving and len(llm.state.missing_weights) == len(good) - 1
    llm.reload_weights()
    assert outputs(llm) == reference


def test_non_finite_checkpoint_is_refused(llm, reference, tiny_model_path, tmp_path):
    def poison(tensors):
        tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")

    path = scaled_checkpoint(tiny_model_path, tmp_path / "nan", poison)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.down_proj\.weight' holds non-finite"):
        llm.reload_weights(path)
    # The reload wrote the weights before its finite check found the NaN: they were copied to the host first, and
    # are put back, so the engine serves the previous weights, bit for bit.
    assert llm.state.serving and outputs(llm) == reference


def test_without_sleep_mode_a_mix_raises_on_generate(tiny_model_path):
    llm = LLM(tiny_model_path, enable_sleep_mode=False, **OPTIONS)
    reference = outputs(llm)
    good = list(iter_checkpoint(tiny_model_path))

    def stream():
        yield good[0]
        raise OSError("the trainer went away")

    with pytest.raises(CheckpointError, match="the trainer went away"):
        llm.engine.update_weights(stream())
    with pytest.raises(RuntimeError, match="the weights are not whole"):
        llm.generate(PROMPTS, GREEDY)
    llm.engine.update_weights(good[:1])  # a part does not make the mix whole
    assert not llm.state.serving and not llm.state.weights_valid
    llm.engine.update_weights(good)
    assert outputs(llm) == reference
