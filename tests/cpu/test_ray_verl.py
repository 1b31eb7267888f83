"""torpor as verl's rollout ("torpor" in verl's registries), with the real `verl` package on a local Ray cluster
(CPU): the replica launches its server beside the replica's worker; the hybrid weight-sync order of verl's
engine workers (release → resume weights → update_weights → resume kv_cache) through the worker-side rollout;
token-in-token-out generate as verl's agent loop calls it. Skipped where verl does not import."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("verl.workers.rollout.replica", exc_type=ImportError)

from safetensors.torch import load_file  # noqa: E402

from torpor import LLM, SamplingParams  # noqa: E402
from torpor.synthetic import make_model  # noqa: E402

PROMPTS = [[3, 1, 4, 1, 5, 9], [2, 7, 1, 8, 2, 8]]


@ray.remote(num_cpus=0)
class TrainerWorker:
    """Where verl's fused training worker would run: the replica's server starts on its node, with its GPUs."""


def test_verl_rollout_hybrid_cycle(tmp_path):
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    import torpor.ray.verl as torpor_verl

    base = str(make_model("tiny", tmp_path / "base", dtype="float32", progress=False))
    trained = str(make_model("tiny", tmp_path / "trained", seed=4, dtype="float32", progress=False))
    config = RolloutConfig(name="torpor", mode="async", tensor_model_parallel_size=1, prompt_length=16,
                           response_length=12, max_model_len=64, dtype="float32", free_cache_engine=True,
                           enforce_eager=True, engine_kwargs={"torpor": {"num_kv_blocks": 128}})
    model_config = HFModelConfig(path=base)
    assert RolloutReplicaRegistry.get("torpor") is torpor_verl.TorporReplica
    assert get_rollout_class("torpor", "async") is torpor_verl.TorporRollout
    greedy = SamplingParams(temperature=0, max_tokens=12, logprobs=0)

    async def cycle():
        replica = RolloutReplicaRegistry.get("torpor")(replica_rank=0, config=config, model_config=model_config,
                                                       gpus_per_node=1)
        await replica.init_hybrid(SimpleNamespace(workers=[TrainerWorker.remote()]))
        server = replica.server_handle

        async def generate() -> list:
            return await asyncio.gather(*[server.generate.remote(prompt_ids=p, sampling_params={
                "temperature": 0.0, "logprobs": True}, request_id=f"r{i}") for i, p in enumerate(PROMPTS)])

        first = await generate()
        rollout = torpor_verl.TorporRollout(config, model_config, None, replica_rank=0)
        await rollout.release()                                   # sleep (level 2: hybrid)
        await rollout.resume(["weights"])
        weights = ((n, t) for n, t in load_file(os.path.join(trained, "model.safetensors")).items())
        await rollout.update_weights(weights, global_steps=1)
        await rollout.resume(["kv_cache"])
        after = await generate()
        # partial rollout: abort everything in flight and stay paused (requests sent meanwhile are parked, or
        # aborted by id), resume; with reject_request a late request is answered aborted at once
        assert (await server.abort_all_requests.remote())["aborted_count"] == 0
        parked = [asyncio.ensure_future(server.generate.remote(prompt_ids=p, sampling_params={"logprobs": True},
                                                              request_id=f"long{i}")) for i, p in enumerate(PROMPTS)]
        while (await server.stats.remote())["num_waiting"] < 2:
            await asyncio.sleep(0.01)
        assert await server.abort_request.remote("nobody") == {"aborted": False, "error": "Request nobody not found"}
        assert await server.abort_request.remote("long1") == {"aborted": True, "request_id": "long1"}
        assert "long0" in (await server.abort_all_requests.remote())["request_ids"]
        aborted = await asyncio.gather(*parked)
        assert [(o.stop_reason, o.token_ids, o.log_probs) for o in aborted] == [("aborted", [], [])] * 2
        held = asyncio.ensure_future(generate())
        await asyncio.sleep(0.3)
        assert not held.done()  # parked until resume_generation
        await replica.resume_generation()
        assert [o.token_ids for o in await held] == [o.token_ids for o in after]
        assert (await server.abort_all_requests.remote(reject_request=True))["aborted_count"] == 0
        rejected = await server.generate.remote(prompt_ids=PROMPTS[0], sampling_params={}, request_id="late")
        assert rejected.stop_reason == "aborted" and rejected.token_ids == [] and rejected.log_probs is None
        await replica.resume_generation()
        with pytest.raises(ValueError, match="wire_format 'delta_flush' not supported"):
            await rollout.update_weights(iter(()), wire_format="delta_flush")
        await replica.sleep()  # hybrid: level 2, the weights discarded; a wake alone serves nothing stale
        await replica.wake_up()
        with pytest.raises(ray.exceptions.RayTaskError, match="the weights are not whole"):
            await generate()
        await replica.release_kv_cache()  # the next sync: weights in, then the KV cache back
        await rollout.update_weights(((n, t) for n, t in load_file(os.path.join(trained, "model.safetensors")).items()))
        await replica.resume_kv_cache()
        await replica.clear_kv_cache()
        again = await generate()
        ray.kill(server)
        return first, after, again

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        first, after, again = asyncio.run(cycle())
    finally:
        ray.shutdown()
    for outputs, path in ((first, base), (after, trained)):
        reference = LLM(path, device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=128)
        expected = reference.generate(PROMPTS, greedy)
        assert [o.token_ids for o in outputs] == [list(e.outputs[0].token_ids) for e in expected]
        assert all(o.stop_reason == "completed" and len(o.log_probs) == len(o.token_ids) == 12 for o in outputs)
        reference.close()
    assert [o.extra_fields["global_steps"] for o in after] == [1, 1]
    assert [o.token_ids for o in again] == [o.token_ids for o in after]  # sleep / wake: the same answers
