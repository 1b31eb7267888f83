"""The start-up's weight load on a thread of its own (engine/weights/background_load.py): the same bits as the plain
loader, every failure on the caller's thread (a bad header at once, a failed copy or a non-finite value at
`finish`), and an engine started with it answers exactly as one that loads the weights first."""

import json
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from torpor.engine import LLM, SamplingParams
from torpor.engine.attention.torch_backend import TorchAttentionBackend
from torpor.engine.models import ModelConfig, build_model
from torpor.engine.weights.background_load import BackgroundLoad
from torpor.engine.weights.index import CheckpointError
from torpor.engine.weights.loader import load_weights_reference
from torpor.engine.weights.staging import StagingBuffers
from torpor.synthetic import make_model


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """tiny-llama in 3+ shards (fused q/k/v and gate/up in the model)."""
    return make_model("tiny-llama", tmp_path_factory.mktemp("bg") / "llama", progress=False, max_shard_bytes=150_000)


def new_model(path):
    model = build_model(ModelConfig.from_pretrained(path), TorchAttentionBackend(), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # nothing of this survives a complete load
    return model


def copy_of(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def load_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "torpor-weight-load"]


def test_background_load_matches_the_plain_loader(sharded):
    reference = new_model(sharded)
    load_weights_reference(reference, sharded)
    model = new_model(sharded)
    load = BackgroundLoad(model, sharded, StagingBuffers("cpu", buffer_bytes=4096, count=3), None)
    load.finish()
    assert not load_threads()
    for (name, a), (_, b) in zip(reference.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_bad_header_fails_before_any_thread_starts(sharded, tmp_path):
    path = copy_of(sharded, tmp_path / "bad")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = path / sorted(set(index["weight_map"].values()))[0]
    tensors = load_file(shard)
    name = sorted(tensors)[0]
    tensors[name] = torch.zeros(3, 5)  # a shape the model does not have
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        BackgroundLoad(new_model(sharded), path, StagingBuffers("cpu"), None)
    assert not load_threads()


def test_a_failed_copy_is_raised_by_finish(sharded, tmp_path):
    """The files shrink after the plan (replaced while loading): `finish` raises on the caller's thread, with
    weights_written (the engine must not serve them)."""
    path = copy_of(sharded, tmp_path / "shrinks")
    model = new_model(path)
    started = threading.Event()
    original = StagingBuffers.take

    def take_after_shrinking(self, count, nbytes):  # the plan is made; now the files change under it
        for file in path.glob("*.safetensors"):
            file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
        started.set()
        return original(self, count, nbytes)

    staging = StagingBuffers("cpu", buffer_bytes=4096, count=2)
    staging.take = take_after_shrinking.__get__(staging)
    load = BackgroundLoad(model, path, staging, None)
    with pytest.raises(CheckpointError, match="the file ended early") as error:
        load.finish()
    assert started.is_set() and error.value.weights_written and not load_threads()


def test_a_non_finite_value_is_refused_at_finish(sharded, tmp_path):
    path = copy_of(sharded, tmp_path / "nan")
    shard = next(iter(sorted(path.glob("*.safetensors"))))
    tensors = load_file(shard)
    name = sorted(tensors)[-1]
    tensors[name][..., 0] = float("inf")
    save_file(tensors, str(shard))
    load = BackgroundLoad(new_model(path), path, StagingBuffers("cpu"), None)
    with pytest.raises(CheckpointError, match=f"{name}.*non-finite") as error:
        load.finish()
    assert error.value.weights_written


def test_abandon_waits_for_the_copies(sharded):
    """A start-up that fails meanwhile joins the load before the parameters can go (nothing writes into them
    afterwards)."""
    model = new_model(sharded)
    load = BackgroundLoad(model, sharded, StagingBuffers("cpu", buffer_bytes=4096, count=2), None)
    load.abandon()
    assert not load_threads()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_an_engine_started_beside_its_load_answers_as_after_a_reload(tiny_model_path):
    """The start-up's load (beside the KV sizing) writes what a plain reload of the same checkpoint writes."""
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10]]
    llm = LLM(tiny_model_path, device="cpu", max_num_seqs=4, max_model_len=128)
    try:
        assert not load_threads()
        answers = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
        llm.reload_weights()
        again = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
    finally:
        llm.close()
    assert answers == again


def test_reader_threads_follow_the_cores_this_process_may_use(sharded):
    """The loader counts the cores of its affinity (a container's CPU set), not the host's; beside the start-up it
    reads with half of them; a count given (EngineConfig.load_threads) sets both."""
    import subprocess
    import sys

    from torpor.engine.weights.staging import usable_cpus

    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from torpor.engine.weights.staging import StagingBuffers, usable_cpus; "
            "print(usable_cpus(), StagingBuffers('cpu', count=8).threads)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.split()
    assert out == ["1", "1"]
    staging = StagingBuffers("cpu", count=8)
    load = BackgroundLoad(new_model(sharded), sharded, staging, None)
    load.finish()
    assert staging.threads == min(8, usable_cpus()) and load.threads == max(1, staging.threads // 2)
    staging = StagingBuffers("cpu", count=8, threads=3)
    load = BackgroundLoad(new_model(sharded), sharded, staging, None)
    load.finish()
    assert staging.threads == 3 and load.threads == 3


def test_staging_buffers_allocated_ahead_are_the_ones_the_load_takes(sharded):
    """`prefetch` allocates the kept buffers on a thread while the start-up goes on; the first load waits for
    them and reads through exactly those (same addresses), bit for bit like the plain loader."""
    from torpor.engine.weights.index import checkpoint_bytes
    from torpor.engine.weights.loader import load_weights

    staging = StagingBuffers("cpu", buffer_bytes=4096, count=3, keep=True)
    staging.prefetch(checkpoint_bytes(sharded))
    model = new_model(sharded)
    staging._wait_prefetch()  # what the first load's take does first
    ahead = [b.ptr for b in staging.buffers]
    assert len(ahead) == 3 and all(b.size >= 4096 for b in staging.buffers)
    load_weights(model, sharded, staging)
    assert [b.ptr for b in staging.buffers] == ahead
    load_weights(model, sharded, staging)  # a reload keeps them
    assert [b.ptr for b in staging.buffers] == ahead
    reference = new_model(sharded)
    load_weights_reference(reference, sharded)
    assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), model.state_dict().values(),
                                                 strict=True))
    staging.close()
    assert staging.buffers == [] and not [t for t in threading.enumerate() if t.name == "torpor-staging-prefetch"]


def test_no_prefetch_for_buffers_given_back_or_an_unreadable_checkpoint(tmp_path):
    from torpor.engine.weights.index import checkpoint_bytes

    assert checkpoint_bytes(tmp_path / "nothing-here") == 0  # the load itself says what is wrong
    given_back = StagingBuffers("cpu")  # CPU buffers are plain memory, given back after each load
    given_back.prefetch(1 << 20)
    assert given_back.buffers == [] and given_back._prefetch is None
