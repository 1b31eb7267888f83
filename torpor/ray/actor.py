"""`EngineActor`: a Ray actor holding one torpor engine (an `LLM`, its tensor-parallel ranks inside it).

The actor is threaded, with three concurrency groups so that no kind of call waits behind another:

- "generate" (default, many threads): `generate` calls from every caller run at once and batch together in
  the one engine (`LLM` lets many threads drive it; each collects its own outputs).
- "control" (one thread): sleep, wake, pause, abort, weights and their version label, cache, collective_rpc,
  run in the order they were sent; a weight receive that blocks while the trainer broadcasts holds only this
  thread.
- "health" (two threads): `ping`, `stats`, `info`, `get_weight_version` answer while the others are busy, so a
  fleet sees within seconds whether the process is alive.

Only `LLM`'s public methods are used, so the engine's internals may change underneath.
"""

from __future__ import annotations

import functools
import os
import pickle
import threading
import time
import uuid
from typing import Any

import ray

GENERATE_CONCURRENCY = 256  # `generate` calls one replica runs at once (each a thread; they batch in the engine)


def portable(method):
    """Errors that reach the caller as themselves: an exception Ray cannot rebuild on the caller's side (one
    whose constructor takes other arguments than its message) becomes its nearest built-in base (ValueError,
    RuntimeError, ...) with the original type's name in the message."""

    @functools.wraps(method)
    def call(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except Exception as error:
            try:
                pickle.loads(pickle.dumps(error))
                portable_error = None
            except Exception:
                base = next(c for c in type(error).__mro__ if c.__module__ == "builtins")
                portable_error = base(f"{type(error).__name__}: {error}")
            if portable_error is None:
                raise
            raise portable_error from None

    return call


CONCURRENCY = {"concurrency_groups": {"control": 1, "health": 2}, "max_concurrency": GENERATE_CONCURRENCY}


class EngineReplica:
    """One engine replica (the class of `EngineActor`; `torpor.ray.openrlhf` extends it):
    `EngineActor.options(num_gpus=..., scheduling_strategy=...).remote(model, ...)`.

    model: a checkpoint folder or Hub id (None: the embedded tiny model). device: "auto" (the GPU(s) Ray gave
    this actor, else the CPU), "cpu" or "cuda". engine_kwargs: `LLM`'s keyword arguments (dtype, max_model_len,
    tensor_parallel_size, ...). visible_devices: physical GPU ids this process should see (a replica spanning
    several placement-group bundles; see placement.py), set before CUDA starts. replica_index: its place in a
    fleet (shown in errors)."""

    def __init__(self, model: str | None = None, device: str = "auto", engine_kwargs: dict | None = None,
                 visible_devices: list[int] | None = None, replica_index: int = 0,
                 wait_if_asleep: float | None = 0.0, wait_if_paused: float | None = 0.0) -> None:
        if visible_devices is not None:  # before torch initializes CUDA in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(int(d)) for d in visible_devices)
        # Imported here, in the actor's process, after the line above: a driver that only routes never loads the
        # engine's modules, and CUDA starts with the visible devices set.
        import torch

        from torpor.engine.llm import LLM  # torch and the engine load in the actor's process, not the driver's

        if device == "auto":
            device = "cuda" if ray.get_gpu_ids() or visible_devices else "cpu"
        threads = int(ray.get_runtime_context().get_assigned_resources().get("CPU", 0) or 0)
        if device == "cpu" and threads >= 1:
            torch.set_num_threads(threads)  # the CPUs Ray gave this replica, not every core of the host
        self.replica_index = replica_index
        self.incarnation = uuid.uuid4().hex  # a restarted replica is a new incarnation
        # wait_if_asleep: 0 (a fleet refuses requests while it sleeps); OpenRLHF's surface lets them wait.
        # wait_if_paused: how long requests sent during a pause wait for the resume.
        self.llm = LLM(model, device=device, wait_if_asleep=wait_if_asleep, wait_if_paused=wait_if_paused,
                       **(engine_kwargs or {}))
        self._lock = threading.Lock()
        self._in_flight = 0      # prompts inside `generate` now
        self._served = 0         # prompts answered
        self._started = time.time()

    # ---- generation ---------------------------------------------------------------------------------
    @portable
    def generate(self, prompts, sampling_params=None, request_ids: list[str] | None = None) -> list:
        """`LLM.generate`: outputs in input order (RequestOutput objects, vLLM's shape); `request_ids` (one per
        prompt) make them abortable by id."""
        count = len(prompts) if isinstance(prompts, list | tuple) else 1
        with self._lock:
            self._in_flight += count
        try:
            outputs = self.llm.generate(prompts, sampling_params, use_tqdm=False, request_ids=request_ids)
        finally:
            with self._lock:
                self._in_flight -= count
        with self._lock:
            self._served += len(outputs)
        return outputs

    # ---- control (one at a time, in order) -------------------------------------------------------------
    @ray.method(concurrency_group="control")
    @portable
    def sleep(self, level: int = 1, mode: str = "wait"):
        return self.llm.sleep(level, mode)

    @ray.method(concurrency_group="control")
    @portable
    def wake_up(self, tags: list[str] | None = None):
        return self.llm.wake_up(tags)

    @ray.method(concurrency_group="control")
    @portable
    def is_sleeping(self) -> bool:
        return self.llm.is_sleeping()

    @ray.method(concurrency_group="control")
    @portable
    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """`LLM.pause_generation`: "abort", "wait", "keep" (requests frozen with their KV), "retract"; requests
        sent meanwhile wait for `resume_generation`."""
        self.llm.pause_generation(mode, clear_cache)

    @ray.method(concurrency_group="control")
    @portable
    def resume_generation(self) -> None:
        self.llm.resume_generation()

    @ray.method(concurrency_group="control")
    @portable
    def is_paused(self) -> bool:
        return self.llm.is_paused()

    @ray.method(concurrency_group="control")
    @portable
    def abort_requests(self, request_ids: list[str] | None = None) -> int:
        """Abort these requests (None: every one) without pausing; their `generate` returns them, finish_reason
        "abort". Returns how many this replica held."""
        return self.llm.abort_requests(request_ids)

    @ray.method(concurrency_group="control")
    @portable
    def update_weight_version(self, new_version: int | str) -> None:
        """The label of the weights served (the engine's: tokens sampled from now on carry it)."""
        self.llm.update_weight_version(str(new_version))

    @ray.method(concurrency_group="control")
    @portable
    def reload_weights(self, path: str | None = None) -> None:
        return self.llm.reload_weights(path)

    @ray.method(concurrency_group="control")
    @portable
    def update_weights(self, named_tensors) -> int:
        """Named tensors (pairs, a {name: tensor} dict, or an ObjectRef of either: a fleet's kept weights)."""
        if isinstance(named_tensors, ray.ObjectRef):
            named_tensors = ray.get(named_tensors)
        if isinstance(named_tensors, dict):
            named_tensors = list(named_tensors.items())
        return self.llm.update_weights(named_tensors)

    @ray.method(concurrency_group="control")
    @portable
    def update_weights_from_tensor(self, named_tensors=None, load_format: str | None = None, flush_cache: bool = True,
                                   serialized_named_tensors: list[str] | None = None) -> int:
        return self.llm.update_weights_from_tensor(named_tensors, load_format, flush_cache, serialized_named_tensors)

    @ray.method(concurrency_group="control")
    @portable
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str | None = None, timeout: float = 120.0) -> None:
        return self.llm.init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name,
                                                  backend, timeout)

    @ray.method(concurrency_group="control")
    @portable
    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list[list[int]],
                                        group_name: str, flush_cache: bool = True) -> int:
        return self.llm.update_weights_from_distributed(names, dtypes, shapes, group_name, flush_cache)

    @ray.method(concurrency_group="control")
    @portable
    def destroy_weights_update_group(self, group_name: str) -> None:
        return self.llm.destroy_weights_update_group(group_name)

    @ray.method(concurrency_group="control")
    @portable
    def reset_prefix_cache(self) -> bool:
        return self.llm.reset_prefix_cache()

    @ray.method(concurrency_group="control")
    @portable
    def collective_rpc(self, method: str, args: tuple | list = (), kwargs: dict | None = None) -> list:
        return self.llm.collective_rpc(method, args, kwargs)

    @ray.method(concurrency_group="control")
    @portable
    def memory_usage(self) -> dict:
        return self.llm.memory_usage()

    @ray.method(concurrency_group="control")
    @portable
    def state(self):
        return self.llm.state

    # ---- health (answers while the others are busy) ---------------------------------------------------
    @ray.method(concurrency_group="health")
    @portable
    def ping(self) -> str:
        """This incarnation's id (a fleet's liveness probe)."""
        return self.incarnation

    @ray.method(concurrency_group="health")
    @portable
    def get_weight_version(self) -> str:
        return self.llm.get_weight_version()

    @ray.method(concurrency_group="health")
    @portable
    def info(self) -> dict[str, Any]:
        """Where this replica runs: process id, node, device, tensor-parallel size, incarnation."""
        context = ray.get_runtime_context()
        return {"replica": self.replica_index, "pid": os.getpid(), "node_id": context.get_node_id(),
                "device": self.llm.config.device, "tensor_parallel_size": self.llm.config.tensor_parallel_size,
                "gpu_ids": ray.get_gpu_ids(), "incarnation": self.incarnation}

    @ray.method(concurrency_group="health")
    @portable
    def stats(self) -> dict[str, Any]:
        """State, queue, KV cache bytes resident, requests in flight and served. The engine's state is read
        between two of its steps (`LLM.state`), so this waits at most one step, or for a control call that
        holds the engine (a weight receive): a fleet bounds it with its timeout."""
        state = self.llm.state
        kv = state.tags.get("kv_cache")
        kv_bytes = None
        if self.llm.memory is not None:
            kv_bytes = self.llm.memory_usage()["tags"].get("kv_cache", {}).get("resident_bytes")
        with self._lock:
            in_flight, served = self._in_flight, self._served
        return {"replica": self.replica_index, "serving": state.serving, "sleep_level": state.sleep_level,
                "weights_valid": state.weights_valid, "num_running": state.num_running,
                "num_waiting": state.num_waiting, "in_flight": in_flight, "served": served,
                "kv_cache": kv, "kv_cache_resident_bytes": kv_bytes, "weight_version": self.llm.get_weight_version(),
                "uptime_s": time.time() - self._started}

    @ray.method(concurrency_group="health")
    @portable
    def close(self) -> None:
        """Stop the engine's tensor-parallel workers (before the actor is killed)."""
        self.llm.close()


EngineActor = ray.remote(**CONCURRENCY)(EngineReplica)
