"""OpenRLHF's rollout engines, served by torpor: `create_engines(...)` (the arguments of OpenRLHF's
`create_vllm_engines` that apply) returns Ray actors with the methods and signatures of its `RolloutRayActor`
(`openrlhf/trainer/ray/vllm_engine.py`), so its trainer (`ray/ppo_actor.py`) drives them unchanged:

    engines = create_engines(num_engines, tensor_parallel_size, pretrain, seed, full_determinism,
                             enable_prefix_caching, enforce_eager, max_model_len, shared_pg=pg,
                             vllm_enable_sleep=True)
    # _init_vllm_sync_group: engine i joins at rank i·TP + 1 while the trainer, rank 0, hosts the group
    refs = [e.init_process_group.remote(addr, port, i * tp + 1, world, "openrlhf", backend="nccl", use_ray=False)
            for i, e in enumerate(engines)]
    group = stateless_init_process_group(addr, port, 0, world, device)  # this module's, torpor's group
    ray.get(refs)
    # broadcast_to_vllm, per parameter: every engine's update_weight.remote(...) while rank 0 broadcasts
    refs = [e.update_weight.remote(name, dtype=p.dtype, shape=p.shape, empty_cache=last) for e in engines]
    group.broadcast(p.data, src=0, stream=torch.cuda.current_stream())
    ray.get(refs)

The trainer's side of the group must be torpor's (`stateless_init_process_group` here, in place of OpenRLHF's,
which builds vLLM's `StatelessProcessGroup` + `PyNcclCommunicator`): the engine joins a torch process group on the
trainer's TCP store. Differences from vLLM's actor, each refused by name or documented in docs/ray.md:
`use_ray=True` (ray.util.collective) is refused; `sampling_params` is a torpor SamplingParams (vLLM's field names)
or a dict of its fields. `pause_generation()` is vLLM's `pause_generation(mode="keep")`, as OpenRLHF's actor calls
it: running requests freeze and, since the cache is cleared, recompute under the new weights after the resume.
"""

from __future__ import annotations

import ray
import torch
from ray.util.placement_group import placement_group
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from torpor.engine.sampling_params import SamplingParams
from torpor.engine.weights.transport import UpdateGroup, broadcast, destroy_group_handle, open_update_group
from torpor.ray.actor import CONCURRENCY, EngineReplica, portable
from torpor.ray.placement import caller_slots

GROUP_NAME = "openrlhf"  # the group name OpenRLHF's trainer gives every engine
WAIT_IF_ASLEEP_S = 600.0  # a generate sent while the engine sleeps or is paused waits this long for the wake


class OpenRLHFReplica(EngineReplica):
    """An `EngineReplica` with the methods of OpenRLHF's `RolloutRayActor` (its names, arguments and answers)."""

    def __init__(self, model: str, device: str = "auto", engine_kwargs: dict | None = None,
                 visible_devices: list[int] | None = None, replica_index: int = 0) -> None:
        super().__init__(model, device, engine_kwargs, visible_devices, replica_index, wait_if_asleep=WAIT_IF_ASLEEP_S,
                         wait_if_paused=WAIT_IF_ASLEEP_S)
        self._group_name: str | None = None

    @ray.method(concurrency_group="control")
    @portable
    def init_process_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                           group_name: str, backend: str = "nccl", use_ray: bool = False) -> None:
        """Join the trainer's group: this engine's ranks at rank_offset + tp rank (the trainer is rank 0)."""
        if use_ray:
            raise ValueError("init_process_group: use_ray=True (a ray.util.collective group) is not supported; the "
                             "engine joins a torch process group on the trainer's store (use_ray=False)")
        if not group_name:
            raise ValueError("init_process_group: group_name must not be empty")
        self.llm.init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name, backend)
        self._group_name = group_name

    @ray.method(concurrency_group="control")
    @portable
    def update_weight(self, name: str, dtype: torch.dtype, shape, empty_cache: bool = False) -> None:
        """Receive one parameter broadcast by the trainer's rank 0 and load it (fused names handled)."""
        if self._group_name is None:
            raise ValueError("update_weight: call init_process_group first")
        self.llm.update_weights_from_distributed([name], [dtype], [list(shape)], self._group_name,
                                                 flush_cache=bool(empty_cache))

    @ray.method(concurrency_group="control")
    @portable
    def update_weight_cuda_ipc(self, name: str, dtype: torch.dtype, shape, ipc_handles: dict,
                               empty_cache: bool = False) -> None:
        """Load one parameter from the trainer worker on this engine's GPU: `ipc_handles` maps a GPU's UUID to
        `torch.multiprocessing.reductions.reduce_tensor`'s (rebuild function, arguments)."""
        tensor = _tensor_from_ipc(self.llm.config.device, name, dtype, shape, ipc_handles)
        self.llm.update_weights_from_tensor([(name, tensor)], flush_cache=bool(empty_cache))
        torch.cuda.synchronize()

    @ray.method(concurrency_group="control")
    @portable
    def wake_up(self, tags: list[str] | None = None):
        """Wake `tags` one at a time (None: "weights", then "kv_cache"), as OpenRLHF's actor does."""
        result = None
        for tag in tags if tags is not None else ["weights", "kv_cache"]:
            result = self.llm.wake_up([tag])
        return result

    @ray.method(concurrency_group="control")
    @portable
    def pause_generation(self) -> None:
        """Freeze generation (vLLM's mode "keep", clear_cache=True): running requests stop and are recomputed after
        `resume_generation()` (under the weights sent meanwhile); requests sent meanwhile wait."""
        self.llm.pause_generation("keep", True)

    @ray.method(concurrency_group="control")
    @portable
    def resume_generation(self) -> None:
        self.llm.resume_generation()

    @portable
    def generate(self, prompt_token_ids: list[int], sampling_params, multi_modal_data=None):
        """One prompt of token ids; returns its final RequestOutput (vLLM's shape)."""
        if multi_modal_data:
            raise ValueError("generate: multi_modal_data is not supported (text models only)")
        return super().generate([{"prompt_token_ids": list(prompt_token_ids)}], _sampling_params(sampling_params))[0]

    @ray.method(concurrency_group="health")
    @portable
    def get_num_unfinished_requests(self) -> int:
        with self._lock:
            return self._in_flight


RolloutRayActor = ray.remote(**CONCURRENCY)(OpenRLHFReplica)


def create_engines(num_engines: int, tensor_parallel_size: int, pretrain: str, seed: int, full_determinism: bool,
                   enable_prefix_caching: bool, enforce_eager: bool, max_model_len: int, shared_pg=None,
                   gpu_memory_utilization: float | None = None, vllm_enable_sleep: bool = False,
                   logprobs_mode: str | None = None, agent_func_path: str | None = None,
                   remote_rm_url: str | None = None, max_images_per_prompt: int = 0, *, device: str = "auto",
                   dtype: str = "bfloat16", engine_kwargs: dict | None = None, start_timeout: float = 600.0) -> list:
    """OpenRLHF's `create_vllm_engines`: `num_engines` actors of `tensor_parallel_size` ranks, engine i seeded
    `seed + i`, packed into one placement group (one GPU per rank), or into `shared_pg` (hybrid: each engine takes
    0.2 of its bundle's GPU next to the trainer's workers); asleep (level 1) at the end with `vllm_enable_sleep`.
    `full_determinism` needs nothing (a seeded request samples the same tokens whatever shares its batch).
    Refused by name: `logprobs_mode`, `agent_func_path`, `remote_rm_url`, `max_images_per_prompt` (agents, reward
    services and images are the trainer's, not the engine's, here). Keyword-only additions: `device`, `dtype`
    (OpenRLHF's engines are bfloat16), `engine_kwargs` (more `LLM` arguments)."""
    refused = {"logprobs_mode": logprobs_mode, "agent_func_path": agent_func_path, "remote_rm_url": remote_rm_url,
               "max_images_per_prompt": max_images_per_prompt or None}
    named = [name for name, value in refused.items() if value is not None]
    if named:
        raise ValueError(f"create_engines: {', '.join(named)} not supported by torpor's engines")
    use_gpu = device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    tp = tensor_parallel_size
    hybrid = shared_pg is not None
    if not hybrid:
        bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
        shared_pg = placement_group([bundle] * (num_engines * tp), strategy="PACK")
        ray.get(shared_pg.ready(), timeout=start_timeout)
    share = 0.2 if hybrid else 1.0
    slots = caller_slots(shared_pg, None, num_engines, tp, use_gpu, share, share if hybrid else 1, start_timeout)
    kwargs = {"dtype": dtype, "seed": seed, "max_model_len": max_model_len, "enforce_eager": enforce_eager,
              "enable_prefix_caching": enable_prefix_caching, "tensor_parallel_size": tp, **(engine_kwargs or {})}
    if gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    engines = [RolloutRayActor.options(max_restarts=0, **slot.actor_options()).remote(
        pretrain, "cuda" if use_gpu else "cpu", {**kwargs, "seed": seed + i}, slot.visible_devices, i)
        for i, slot in enumerate(slots)]
    ray.get([e.ping.remote() for e in engines], timeout=start_timeout)
    if vllm_enable_sleep:
        ray.get([e.sleep.remote() for e in engines], timeout=start_timeout)
    return engines


class StatelessProcessGroup:
    """The trainer's end, in place of OpenRLHF's `stateless_init_process_group` result: `broadcast(tensor, src=0,
    stream=None)` sends rank 0's tensor to every engine rank (in place); `close()` leaves."""

    def __init__(self, group: UpdateGroup) -> None:
        self.group = group

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream=None) -> None:
        if src != 0:
            raise ValueError(f"broadcast: the trainer is rank 0 and the only source, got src={src}")
        if stream is not None:  # the broadcast runs on the group's stream once the caller's work is done
            stream.synchronize()
        broadcast(self.group, tensor)

    def close(self) -> None:
        destroy_group_handle(self.group)


def stateless_init_process_group(master_address: str, master_port: int, rank: int, world_size: int, device,
                                 group_name: str = GROUP_NAME, backend: str | None = None,
                                 timeout: float = 120.0) -> StatelessProcessGroup:
    """OpenRLHF's `stateless_init_process_group(master_address, master_port, rank, world_size, device)` for a
    torpor fleet: hosts the group (rank 0) and returns once every engine rank joined. NCCL on a CUDA `device`,
    gloo on the CPU (`backend` to choose)."""
    if rank != 0:
        raise ValueError(f"stateless_init_process_group: the trainer joins as rank 0, got rank {rank}")
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return StatelessProcessGroup(open_update_group(master_address, master_port, 0, world_size, group_name, backend,
                                                   device, timeout))


def _sampling_params(value) -> SamplingParams:
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, dict):
        return SamplingParams(**value)
    raise ValueError(f"sampling_params must be a torpor SamplingParams (vLLM's field names) or a dict of its fields, "
                     f"got {type(value).__module__}.{type(value).__name__}")


def _tensor_from_ipc(device: str, name: str, dtype, shape, ipc_handles: dict) -> torch.Tensor:
    """The trainer's tensor on this engine's GPU from OpenRLHF's `{gpu_uuid: (rebuild, args)}` handles; only
    torch's CUDA-tensor rebuild function is called (the handles crossed a process boundary)."""
    if not device.startswith("cuda"):
        raise ValueError("update_weight_cuda_ipc needs a CUDA engine (CPU engines take update_weight)")
    index = torch.device(device).index or 0
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    if not isinstance(ipc_handles, dict) or uuid not in ipc_handles:
        raise ValueError(f"update_weight_cuda_ipc: no handle for this engine's GPU {uuid} "
                         f"(handles for {sorted(ipc_handles) if isinstance(ipc_handles, dict) else ipc_handles!r})")
    function, args = ipc_handles[uuid]
    if function is not rebuild_cuda_tensor:
        raise ValueError(f"update_weight_cuda_ipc: the handle's function must be torch's rebuild_cuda_tensor, "
                         f"got {function!r}")
    args = list(args)
    args[6] = index  # the device index as this process numbers it (another CUDA_VISIBLE_DEVICES than the trainer's)
    tensor = function(*args)
    if tensor.dtype != dtype or list(tensor.shape) != list(shape):
        raise ValueError(f"update_weight_cuda_ipc: {name!r} arrived as {tensor.dtype} {list(tensor.shape)}, "
                         f"announced as {dtype} {list(shape)}")
    return tensor
