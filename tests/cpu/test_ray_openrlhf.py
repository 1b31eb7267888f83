"""torpor.ray.openrlhf driven as OpenRLHF's trainer drives its vLLM engines (ppo_actor.py, vllm_engine.py), on a
local Ray cluster with gloo: create (asleep) → the sync group (engine i at rank i·TP + 1, the trainer rank 0) →
wake → generate → sleep → wake weights → per parameter update_weight on every engine while rank 0 broadcasts, the
prefix-cache reset alongside → wake → generate with the new weights; pause / resume."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")

from safetensors.torch import load_file  # noqa: E402

from torpor import LLM, SamplingParams  # noqa: E402
from torpor.rl.engine_process import free_port  # noqa: E402
from torpor.synthetic import make_model  # noqa: E402

KV = {"num_kv_blocks": 256}
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3], [5, 8, 9, 7, 9]]


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_openrlhf_trainer_call_order(cluster, tmp_path):
    from torpor.ray.openrlhf import create_engines, stateless_init_process_group

    pretrain = str(make_model("tiny", tmp_path / "base", dtype="float32", progress=False))
    trained = str(make_model("tiny", tmp_path / "trained", seed=2, dtype="float32", progress=False))
    with pytest.raises(ValueError, match="remote_rm_url, max_images_per_prompt not supported"):
        create_engines(1, 1, pretrain, 0, False, True, True, 96, remote_rm_url="http://rm", max_images_per_prompt=2,
                       device="cpu")
    engines = create_engines(2, 1, pretrain, 0, False, True, True, 96, vllm_enable_sleep=True, device="cpu",
                             dtype="float32", engine_kwargs=KV)
    assert all(ray.get([e.is_sleeping.remote() for e in engines]))

    # _init_vllm_sync_group: the engines' init_process_group calls, then the trainer's group, then ray.get
    address, port, tp = "127.0.0.1", free_port(), 1
    world_size = len(engines) * tp + 1
    refs = [engine.init_process_group.remote(address, port, i * tp + 1, world_size, "openrlhf", backend="gloo",
                                             use_ray=False) for i, engine in enumerate(engines)]
    group = stateless_init_process_group(address, port, 0, world_size, "cpu")
    ray.get(refs, timeout=60)
    with pytest.raises(ray.exceptions.RayTaskError, match="use_ray=True"):
        ray.get(engines[0].init_process_group.remote(address, port, 1, 3, "other", "gloo", True))

    greedy = SamplingParams(temperature=0, max_tokens=10)
    ray.get([e.wake_up.remote() for e in engines])  # wake_up(None): weights, then kv_cache
    answers = ray.get([engines[i % 2].generate.remote(p, greedy) for i, p in enumerate(PROMPTS)])
    base = LLM(pretrain, device="cpu", dtype="float32", max_model_len=96, **KV)
    assert [a.outputs[0].token_ids for a in answers] == [o.outputs[0].token_ids for o in base.generate(PROMPTS, greedy)]
    ray.get([e.sleep.remote() for e in engines])  # level 1 after the rollout

    # broadcast_to_vllm, as PPOTrainer runs it: weights awake first, the cache reset alongside, one call per param
    ray.get([e.wake_up.remote(tags=["weights"]) for e in engines])
    cache_reset_refs = [e.reset_prefix_cache.remote() for e in engines]
    params = list(load_file(os.path.join(trained, "model.safetensors")).items())
    for count, (name, param) in enumerate(params, 1):
        refs = [e.update_weight.remote(name, dtype=param.dtype, shape=param.shape, empty_cache=count == len(params))
                for e in engines]
        group.broadcast(param.data, src=0, stream=None)
        ray.get(refs, timeout=60)
    ray.get(cache_reset_refs, timeout=60)
    ray.get([e.wake_up.remote(tags=["kv_cache"]) for e in engines])
    reference = LLM(trained, device="cpu", dtype="float32", max_model_len=96, **KV)
    expected = [o.outputs[0].token_ids for o in reference.generate(PROMPTS, greedy)]
    for engine in engines:  # both engines serve the broadcast weights
        assert [a.outputs[0].token_ids for a in ray.get([engine.generate.remote(p, greedy) for p in PROMPTS])] \
            == expected

    # the async trainer: pause, (weights), resume; a request sent during the pause waits and is answered after
    ray.get(engines[0].pause_generation.remote())
    waiting = engines[0].generate.remote(PROMPTS[0], {"temperature": 0, "max_tokens": 10})
    ready, _ = ray.wait([waiting], timeout=1.0)
    assert not ready and ray.get(engines[0].get_num_unfinished_requests.remote()) == 1
    ray.get(engines[0].resume_generation.remote())
    assert ray.get(waiting, timeout=60).outputs[0].token_ids == expected[0]
    with pytest.raises(ray.exceptions.RayTaskError, match="update_weight_cuda_ipc needs a CUDA engine"):
        ray.get(engines[1].update_weight_cuda_ipc.remote(params[0][0], params[0][1].dtype, params[0][1].shape, {}))
    with pytest.raises(ray.exceptions.RayTaskError, match="sampling_params must be a torpor SamplingParams"):
        ray.get(engines[1].generate.remote(PROMPTS[0], object()))

    group.close()
    for engine in engines:
        ray.get(engine.close.remote())
        ray.kill(engine)
    base.close()
    reference.close()
