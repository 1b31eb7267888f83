"""torpor.ray on one GPU: two replicas colocated with a trainer actor in the caller's placement group (fractional
GPUs), weights by CUDA IPC from the trainer to both (per-replica payloads), answers equal to an engine started on
the pushed weights; OpenRLHF's `update_weight_cuda_ipc` from the trainer on the same GPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytestmark = pytest.mark.gpu
ray = pytest.importorskip("ray")

from safetensors.torch import load_file  # noqa: E402

from torpor import LLM, SamplingParams  # noqa: E402
from torpor.synthetic import make_model  # noqa: E402

ENGINE = {"dtype": "bfloat16", "max_model_len": 256, "max_num_seqs": 8, "num_kv_blocks": 64,
          "gpu_memory_utilization": 0.1}
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [4, 4, 4, 4]]


@ray.remote
class Trainer:
    """A trainer worker on the replicas' GPU: holds the new weights on it and shares them by reference."""

    def __init__(self, path: str) -> None:
        self.named = [(n, t.cuda()) for n, t in load_file(os.path.join(path, "model.safetensors")).items()]
        torch.cuda.synchronize()

    def buckets(self) -> list[str]:
        from torpor.rl import bucket_named_tensors, serialize

        self.kept = list(bucket_named_tensors(self.named, 64 << 20))
        torch.cuda.synchronize()
        return [serialize(b.payload()) for b in self.kept]

    def ipc_handles(self) -> list[tuple]:
        from torch.multiprocessing.reductions import reduce_tensor

        uuid = str(torch.cuda.get_device_properties(0).uuid)
        return [(n, t.dtype, list(t.shape), {uuid: reduce_tensor(t)}) for n, t in self.named]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-gpu")
    return (str(make_model("tiny", root / "base", progress=False)),
            str(make_model("tiny", root / "pushed", seed=1, progress=False)))


def test_colocated_fleet_and_openrlhf_ipc(models):
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from torpor.ray import RolloutFleet
    from torpor.ray.openrlhf import create_engines

    reference = LLM(models[1], device="cuda", **ENGINE)
    expected = [o.outputs[0].token_ids for o in reference.generate(PROMPTS, GREEDY)]
    reference.close()
    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        group = placement_group([{"GPU": 1, "CPU": 4}])
        ray.get(group.ready(), timeout=60)
        on_bundle = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=0)
        trainer = Trainer.options(num_gpus=0.2, num_cpus=1, scheduling_strategy=on_bundle).remote(models[1])
        fleet = RolloutFleet(models[0], num_replicas=2, device="cuda", placement_group=group, bundle_indices=[0, 0],
                             gpu_fraction=0.4, engine_kwargs=ENGINE)
        try:
            for payload in ray.get(trainer.buckets.remote()):  # one list of per-rank payloads per replica
                counts = fleet.update_weights_from_tensor(serialized_named_tensors=[[payload], [payload]],
                                                          load_format="flattened_bucket", weight_version=1)
                assert all(c > 0 for c in counts)
            assert fleet.weight_version == 1
            assert [o.outputs[0].token_ids for o in fleet.generate(PROMPTS, GREEDY)] == expected
        finally:
            fleet.shutdown()
        (engine,) = create_engines(1, 1, models[0], 0, False, True, True, 256, shared_pg=group, device="cuda",
                                   engine_kwargs={k: v for k, v in ENGINE.items() if k != "max_model_len"})
        handles = ray.get(trainer.ipc_handles.remote())
        for count, (name, dtype, shape, ipc) in enumerate(handles, 1):
            ray.get(engine.update_weight_cuda_ipc.remote(name, dtype, shape, ipc, empty_cache=count == len(handles)))
        answers = ray.get([engine.generate.remote(p, GREEDY) for p in PROMPTS])
        assert [a.outputs[0].token_ids for a in answers] == expected
    finally:
        ray.shutdown()
