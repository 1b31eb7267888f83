"""verl's rollout served by torpor: `rollout.name=torpor` (needs the `verl` package; importing this module
registers it).

- `TorporReplica` (verl's `RolloutReplica`, registered as "torpor" in `RolloutReplicaRegistry`): one server actor
  per replica, on the node and GPUs of the replica's workers (hybrid, colocated or standalone mode), holding one
  torpor engine of `tensor_model_parallel_size` ranks.
- `TorporServer`: that actor; verl's server methods (token-in-token-out `generate` → `TokenOutput`, `wake_up`,
  `sleep`, `clear_kv_cache`, `release_kv_cache`, `resume_kv_cache`, `wait_for_requests_to_drain`,
  `set_global_steps`, and for partial rollout `abort_all_requests` (the engine stays paused, as vLLM's server
  leaves it), `abort_request`, `resume_generation`) over an `EngineReplica`.
- `TorporRollout` (verl's `BaseRollout`, in `_ROLLOUT_REGISTRY` as ("torpor", "async")): the trainer worker's
  side in hybrid mode: `resume(tags)` wakes, `release()` sleeps, `update_weights(weights, **kwargs)` sends the
  trainer's tensors in flattened buckets by reference (CUDA IPC on GPU, shared memory on CPU) to the server's
  `update_weights_from_tensor`, then clears the prefix cache.

Not there yet (refused by name): images,
video and audio, the `delta_flush` wire format, multi-node replicas, PD disaggregation; the replica has no HTTP
address (`server_address` is None: verl's token-in-token-out path uses the server handle).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Generator

import ray
import torch
from verl.workers.rollout import base as verl_base
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry, TokenOutput

from torpor.engine.sampling_params import SamplingParams
from torpor.ray.actor import CONCURRENCY, EngineReplica, portable
from torpor.rl.weight_sync import bucket_named_tensors, serialize

SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)
DRAIN_TIMEOUT_S = 600.0


def engine_kwargs_of(config) -> dict:
    """`LLM` arguments from verl's RolloutConfig."""
    kwargs = {"tensor_parallel_size": config.tensor_model_parallel_size, "dtype": config.dtype,
              "max_model_len": config.max_model_len or config.prompt_length + config.response_length,
              "max_num_seqs": config.max_num_seqs, "enforce_eager": config.enforce_eager,
              "enable_prefix_caching": config.enable_prefix_caching, "seed": config.seed,
              "gpu_memory_utilization": config.gpu_memory_utilization}
    if config.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = config.max_num_batched_tokens
    return {**kwargs, **(dict(config.engine_kwargs.get("torpor") or {}) if config.engine_kwargs else {})}


class TorporServer(EngineReplica):
    """verl's rollout server over one torpor engine (see the module)."""

    def __init__(self, model: str, config, rollout_mode: str, replica_rank: int,
                 visible_devices: list[int] | None = None) -> None:
        device = "cuda" if visible_devices else "cpu"
        # requests sent while an abort_all_requests pause holds wait for resume_generation
        super().__init__(model, device, engine_kwargs_of(config), visible_devices, replica_rank,
                         wait_if_paused=DRAIN_TIMEOUT_S)
        self.config, self.rollout_mode, self.global_steps = config, RolloutMode(rollout_mode), None
        self._requests: set[str] = set()   # verl's request ids in flight
        self._rejecting = False            # abort_all_requests(reject_request=True) until resume_generation
        self.max_model_len = self.llm.config.max_model_len

    @portable
    def generate(self, prompt_ids: list[int], sampling_params: dict, request_id: str, image_data=None,
                 video_data=None, audio_data=None, mm_processor_kwargs=None, priority: int = 0,
                 kv_transfer_params=None) -> TokenOutput:
        """Token in, token out (verl's contract): the completion's ids, their logprobs when asked for."""
        given = {"image_data": image_data, "video_data": video_data, "audio_data": audio_data,
                 "mm_processor_kwargs": mm_processor_kwargs, "kv_transfer_params": kv_transfer_params}
        refused = [name for name, value in given.items() if value]
        if refused:
            raise ValueError(f"generate: {', '.join(refused)} not supported by torpor's engine (text only)")
        params = self._sampling_params(list(prompt_ids), dict(sampling_params))
        with self._lock:
            if self._rejecting:  # behind an abort_all_requests(reject_request=True): answered aborted at once
                return TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted",
                                   extra_fields={"global_steps": self.global_steps})
            if request_id in self._requests:
                raise ValueError(f"generate: request {request_id!r} is already running")
            self._requests.add(request_id)
        try:
            output = super().generate([{"prompt_token_ids": list(prompt_ids)}], params, [request_id])[0]
        finally:
            with self._lock:
                self._requests.discard(request_id)
        completion = output.outputs[0]
        log_probs = None
        if params.logprobs is not None:
            log_probs = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids, strict=True)]
        reason = completion.finish_reason
        stop = "aborted" if reason == "abort" else "completed" if reason in ("stop", "length") else reason
        return TokenOutput(token_ids=list(completion.token_ids), log_probs=log_probs, stop_reason=stop,
                           extra_fields={"global_steps": self.global_steps,
                                         "num_cached_tokens": output.num_cached_tokens})

    def _sampling_params(self, prompt_ids: list[int], params: dict) -> SamplingParams:
        """verl's sampling dict as the vLLM server reads it: max_tokens (or max_new_tokens, else the configured
        response length) within the context left, `logprobs` a bool."""
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt length ({len(prompt_ids)}) leaves no room within max_model_len "
                             f"({self.max_model_len})")
        limit = params.pop("max_tokens", params.pop("max_new_tokens", None))
        if limit is None:
            limit = min(self.config.response_length,
                        self.config.prompt_length + self.config.response_length - len(prompt_ids))
        params["max_tokens"] = max(1, min(limit, room))
        params["logprobs"] = 0 if params.pop("logprobs", False) else None
        params.setdefault("repetition_penalty", self.config.repetition_penalty)
        params.setdefault("ignore_eos", self.config.ignore_eos)
        if self.config.full_determinism:
            params.setdefault("seed", self.replica_index + self.config.seed)
        unknown = sorted(set(params) - SAMPLING_FIELDS)
        if unknown:
            raise ValueError(f"sampling_params: {', '.join(unknown)} not supported by torpor's engine")
        return SamplingParams(**params)

    def _sleep_level(self) -> int:
        return 2 if self.rollout_mode == RolloutMode.HYBRID else 1  # hybrid: the trainer sends fresh weights

    @ray.method(concurrency_group="control")
    @portable
    def wake_up(self, tags: list[str] | None = None) -> None:
        if self.rollout_mode == RolloutMode.STANDALONE:
            return
        self.llm.wake_up(tags if self.rollout_mode == RolloutMode.HYBRID else None)
        self.llm.reset_prefix_cache()

    @ray.method(concurrency_group="control")
    @portable
    def sleep(self, level: int | None = None) -> None:
        if self.config.free_cache_engine and self.rollout_mode != RolloutMode.STANDALONE:
            self.llm.sleep(self._sleep_level() if level is None else level)

    @ray.method(concurrency_group="control")
    @portable
    def clear_kv_cache(self) -> None:
        self.llm.reset_prefix_cache()

    @ray.method(concurrency_group="control")
    @portable
    def release_kv_cache(self) -> None:
        """The KV cache away for a weight sync, the weights kept (sleep, then wake the weights)."""
        if self.config.free_cache_engine and self.rollout_mode == RolloutMode.HYBRID:
            self.llm.sleep(self._sleep_level())
            self.llm.wake_up(["weights"])

    @ray.method(concurrency_group="control")
    @portable
    def resume_kv_cache(self) -> None:
        if self.config.free_cache_engine and self.rollout_mode == RolloutMode.HYBRID:
            self.llm.wake_up(["kv_cache"])
            self.llm.reset_prefix_cache()

    @ray.method(concurrency_group="health")
    @portable
    def wait_for_requests_to_drain(self) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while True:
            with self._lock:
                if self._in_flight == 0:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self._in_flight} request(s) still running after {DRAIN_TIMEOUT_S:g} s")
            time.sleep(0.01)

    @ray.method(concurrency_group="health")
    def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    @ray.method(concurrency_group="control")
    @portable
    def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        """Abort every request (their `generate` returns stop_reason "aborted" with the tokens they have) and stay
        paused until `resume_generation` (vLLM's pause_generation(mode="abort"), as verl's vLLM server does):
        requests sent meanwhile wait, or with `reject_request` are answered aborted at once. The prefix cache is
        reset with `reset_prefix_cache`. Returns {"aborted_count", "request_ids"}."""
        with self._lock:
            request_ids = sorted(self._requests)
            self._rejecting = bool(reject_request)
        self.llm.pause_generation("abort", bool(reset_prefix_cache))
        return {"aborted_count": len(request_ids), "request_ids": request_ids}

    @ray.method(concurrency_group="control")
    @portable
    def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        """Abort one request by verl's id: {"aborted": True, "request_id"}, or {"aborted": False, "error"} when it
        is not running here."""
        if self.llm.abort_requests([request_id]) == 0:
            return {"aborted": False, "error": f"Request {request_id} not found"}
        if reset_prefix_cache:
            self.llm.reset_prefix_cache()
        return {"aborted": True, "request_id": request_id}

    @ray.method(concurrency_group="control")
    @portable
    def resume_generation(self) -> None:
        """End the pause of `abort_all_requests`: held requests run, new ones are taken again."""
        with self._lock:
            self._rejecting = False
        self.llm.resume_generation()


class TorporReplica(RolloutReplica):
    """verl's replica of torpor engines (see the module)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(**CONCURRENCY)(TorporServer)

    async def launch_servers(self) -> None:
        """One server actor on the node of the replica's workers, seeing exactly their GPUs."""
        if self.nnodes != 1:
            raise ValueError(f"torpor replicas run on one node (tensor parallel within it), got {self.nnodes} nodes")
        if len(self.workers) != self.world_size:
            raise ValueError(f"{len(self.workers)} workers for a replica of world size {self.world_size}")
        infos = await _gather([w.__ray_call__.remote(_where) for w in self.workers])
        gpus = [int(g) for _, ids in infos for g in ids[:1]]
        options = {"scheduling_strategy": ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
            node_id=infos[0][0], soft=False), "name": f"torpor_server_{self.replica_rank}_0{self.name_suffix}"}
        if gpus:
            options["runtime_env"] = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
        model = self.model_config.local_path if hasattr(self.model_config, "local_path") else self.model_config.path
        server = self.server_class.options(**options).remote(model, self.config, self.rollout_mode.value,
                                                             self.replica_rank, gpus or None)
        await server.ping.remote()
        self.servers = [server]
        self._server_handle, self._server_address = server, None

    async def sleep(self) -> None:
        await self.servers[0].wait_for_requests_to_drain.remote()
        await _gather([s.sleep.remote() for s in self.servers])


class TorporRollout(BaseRollout):
    """The trainer worker's side (hybrid mode): wakes, sleeps and fills its replica's engine (see the module).
    Replica `replica_rank` (default: this worker's RANK // the replica's world size); only the replica's first
    worker talks to the server."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        world = self.config.tensor_model_parallel_size * self.config.data_parallel_size * \
            self.config.pipeline_model_parallel_size
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world
        self.server_handle = None

    def _server(self):
        if self.rollout_rank != 0:
            return None
        if self.server_handle is None:  # the server starts after the hybrid engine: looked up on first use
            self.server_handle = ray.get_actor(f"torpor_server_{self.replica_rank}_0")
        return self.server_handle

    async def resume(self, tags: list[str]) -> None:
        server = self._server()
        if self.config.free_cache_engine and server is not None:
            await server.wake_up.remote(tags=tags)

    async def release(self) -> None:
        server = self._server()
        if self.config.free_cache_engine and server is not None:
            await server.sleep.remote()

    @torch.no_grad()
    async def update_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                             global_steps: int | None = None, wire_format: str = "named_tensors", **kwargs) -> None:
        """Every tensor in flattened buckets of `checkpoint_engine.update_weights_bucket_megabytes`, each sent by
        reference and held until the engine copied it; the prefix cache is cleared after the last."""
        if wire_format != "named_tensors":
            raise ValueError(f"update_weights: wire_format {wire_format!r} not supported (only 'named_tensors')")
        server = self._server()
        if server is None:
            for _ in weights:  # every rank walks the generator (it may gather across ranks)
                pass
            return
        bucket_bytes = int(self.config.checkpoint_engine.update_weights_bucket_megabytes) << 20
        tp = self.config.tensor_model_parallel_size
        pending = None
        for bucket in bucket_named_tensors(weights, bucket_bytes):
            if pending is not None:
                await _send(server, pending, tp, last=False)
            pending = bucket
        if pending is not None:
            await _send(server, pending, tp, last=True)
        await server.clear_kv_cache.remote()
        if global_steps is not None:
            await server.set_global_steps.remote(global_steps)


async def _send(server, bucket, tp: int, last: bool) -> None:
    if bucket.flattened.is_cuda:
        torch.cuda.current_stream(bucket.flattened.device).synchronize()
    payload = serialize(bucket.payload())
    await server.update_weights_from_tensor.remote(None, "flattened_bucket", last, [payload] * tp)


def _where(_actor) -> tuple[str, list]:
    context = ray.get_runtime_context()
    return context.get_node_id(), list(context.get_accelerator_ids().get("GPU", []))


async def _gather(refs: list):
    return await asyncio.gather(*refs)


def register() -> None:
    """`torpor` in verl's replica registry and its worker-side rollout table (a module-level dict there: verl has
    no public call for it)."""
    RolloutReplicaRegistry.register("torpor", lambda: TorporReplica)
    verl_base._ROLLOUT_REGISTRY[("torpor", "async")] = "torpor.ray.verl.TorporRollout"


register()
