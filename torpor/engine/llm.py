"""`LLM`: the offline entry point, `generate(prompts, params) -> [RequestOutput]` (vLLM conventions)."""

from __future__ import annotations

import threading
from collections.abc import Sequence as SequenceABC

import torch

from torpor.engine.config import EngineConfig
from torpor.engine.llm_engine import LLMEngine
from torpor.engine.models import ModelConfig
from torpor.engine.outputs import RequestOutput
from torpor.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """A paged-KV inference engine on one device.

    model: a Hugging Face checkpoint folder; None = the embedded tiny default model.
    device: "auto" (CUDA when available), "cpu", "cuda" or "cuda:N". dtype: "auto" (the checkpoint's),
    "float32", "float16" or "bfloat16". max_model_len: prompt + output tokens of one sequence (default:
    min(4096, the model's max_position_embeddings)). memory: a `torpor.memory.MemoryManager` on the same
    device; every persistent buffer is then allocated in its tag (weights, runtime, kv_cache, workspace,
    cuda_graph). With `enable_sleep_mode` (default) and no `memory`, the LLM makes its own manager;
    `sleep`, `wake_up`, `reload_weights`, `update_weights` and `memory_usage` need one. Further keyword
    arguments are `EngineConfig` fields (block_size, max_num_batched_tokens, num_kv_blocks, ...).

    `tensor_parallel_size=N` splits the model over N processes (rank 0 is this one; on GPU, rank r uses
    the device r places after `device`), see docs/tensor-parallel.md; `worker_memory_options` then maps a
    worker rank to its MemoryManager's keyword arguments (rank 0 uses `memory`). Call `close()` to stop
    the workers (interpreter exit does it too).
    """

    def __init__(self, model: str | None = None, device: str = "auto", dtype: str | torch.dtype = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 256, gpu_memory_utilization: float = 0.9,
                 enforce_eager: bool = False, seed: int = 0, enable_sleep_mode: bool = True, memory=None,
                 worker_memory_options: dict[int, dict] | None = None, **engine_options) -> None:
        from torpor.engine.checkpoint import default_model_path

        path = str(model if model is not None else default_model_path())
        model_config = ModelConfig.from_pretrained(path)
        unknown = sorted(k for k in engine_options if k not in EngineConfig.__dataclass_fields__ or k == "model")
        if unknown:
            raise TypeError(f"unknown LLM option(s): {', '.join(unknown)}")
        config = EngineConfig(
            model=path,
            dtype=_dtype_name(dtype),
            device=_resolve_device(device),
            max_model_len=_resolve_max_model_len(max_model_len, model_config),
            max_num_seqs=max_num_seqs,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            seed=seed,
            **engine_options,
        )
        if memory is None and enable_sleep_mode:
            from torpor.memory import MemoryManager

            memory = MemoryManager(config.device)
        self.engine = LLMEngine(config, memory, worker_memory_options)
        self.memory = self.engine.memory  # under tensor parallelism: sleep and wake reach every rank
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        # One engine, many threads: steps, sleeps and wakes take turns; generate waits while asleep.
        self._lock = threading.Condition(threading.RLock())
        self._finished: dict[str, RequestOutput] = {}

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Complete every prompt (text, or token ids); outputs in input order. Raises ValueError before
        queueing anything if any prompt or parameter is invalid."""
        prompt_list = _prompt_list(prompts)
        params = _params_list(sampling_params, len(prompt_list))
        with self._lock:
            seqs = [self.engine.make_sequence(p, sp) for p, sp in zip(prompt_list, params, strict=True)]
            for seq in seqs:
                self.engine.add_sequence(seq)
        mine = {seq.request_id for seq in seqs}
        outputs: dict[str, RequestOutput] = {}
        try:
            with _progress(use_tqdm, len(seqs)) as advance:
                while len(outputs) < len(seqs):
                    with self._lock:
                        self._step_or_wait()
                        for request_id in mine & self._finished.keys():
                            outputs[request_id] = self._finished.pop(request_id)
                            advance()
        except BaseException:
            with self._lock:
                for request_id in mine - outputs.keys():
                    self.engine.abort_request(request_id)
                    self._finished.pop(request_id, None)
            raise
        return [outputs[seq.request_id] for seq in seqs]

    def _step_or_wait(self) -> None:
        """One engine step, or (asleep) wait until another thread wakes the engine. Called locked."""
        finished = self.engine.step()
        self._finished.update((o.request_id, o) for o in finished)
        if finished:
            self._lock.notify_all()
        if self.engine.scheduler.paused and not finished:
            mode = self.engine.sleep_mode
            if mode is not None and mode.level is None and mode.weights_discarded:
                raise RuntimeError("the weights were discarded by sleep(level=2) and every tag is awake: "
                                   "call reload_weights() or update_weights() before generating")
            self._lock.wait()

    # ---- sleep mode --------------------------------------------------------------------------
    def sleep(self, level: int = 1, running: str = "wait"):
        """Level 0: pause scheduling. Level 1: weights and runtime state to host memory, KV cache
        and scratch discarded. Level 2: as 1, but the weights are discarded too (then
        `reload_weights` or `update_weights`). `running`: "wait" lets running requests finish first,
        "abort" ends them. Returns the memory report (None for a no-op or level 0)."""
        with self._lock:
            report = self.engine.sleep(level, running)
            self._lock.notify_all()
            return report

    def wake_up(self, tags: list[str] | None = None):
        """Wake the named tags (all when None); every wake also restores the runtime state. Requests
        waiting in `generate` run once every tag is awake. Returns a `WakeResult`."""
        with self._lock:
            result = self.engine.wake_up(tags)
            self._lock.notify_all()
            return result

    def is_sleeping(self) -> bool:
        with self._lock:
            return self.engine.is_sleeping()

    def reload_weights(self, path: str | None = None) -> None:
        """Reload the checkpoint (or the one at `path`) into the same weight tensors."""
        with self._lock:
            self.engine.reload_weights(path)
            self._lock.notify_all()

    def update_weights(self, named_tensors) -> int:
        """Copy `(hf_name, tensor)` pairs into the weights (all of them after a level-2 sleep)."""
        with self._lock:
            count = self.engine.update_weights(named_tensors)
            self._lock.notify_all()
            return count

    def memory_usage(self) -> dict:
        """Per-tag bytes and states, the sleep level, device memory in use (rank 0's device); under
        tensor parallelism also "ranks": each rank's device, its memory in use and its tags."""
        with self._lock:
            if self.config.tensor_parallel_size == 1:
                return self.engine.memory_usage()
            from torpor.engine.parallel_runner import usage_with_ranks

            return usage_with_ranks(self.engine)

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (a no-op on one device)."""
        with self._lock:
            self.engine.close()

    # ---- weights from a trainer process (SGLang's names; see weight_transfer.py) -------------
    def update_weights_from_tensor(self, named_tensors=None, load_format: str | None = None,
                                   flush_cache: bool = True, serialized_named_tensors: list[str] | None = None) -> int:
        """New weights by reference: `named_tensors` ((name, tensor) pairs, or with load_format
        "flattened_bucket" a {"flattened_tensor", "metadata"} dict), or SGLang's `serialized_named_tensors`
        (base64 ForkingPickler payloads, one per rank; CUDA IPC or shared memory). Checked before anything
        is written; returns the number of tensors loaded."""
        from torpor.engine import weight_transfer

        with self._lock:
            count = weight_transfer.update_weights_from_tensor(self.engine, serialized_named_tensors, load_format,
                                                               flush_cache, named_tensors)
            self._lock.notify_all()
            return count

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str | None = None, timeout: float = 120.0) -> None:
        """Join the trainer's process group `group_name` as rank `rank_offset` (+ tp rank), gloo or NCCL."""
        from torpor.engine import weight_transfer

        with self._lock:
            weight_transfer.init_weights_update_group(self.engine, master_address, master_port, rank_offset,
                                                      world_size, group_name, backend, timeout)

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list[list[int]],
                                        group_name: str, flush_cache: bool = True) -> int:
        """Receive the trainer's rank-0 broadcast of each named tensor, in order, then load them all."""
        from torpor.engine import weight_transfer

        with self._lock:
            count = weight_transfer.update_weights_from_distributed(self.engine, names, dtypes, shapes, group_name,
                                                                    flush_cache)
            self._lock.notify_all()
            return count

    def destroy_weights_update_group(self, group_name: str) -> None:
        from torpor.engine import weight_transfer

        with self._lock:
            weight_transfer.destroy_weights_update_group(self.engine, group_name)


def _prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, SequenceABC) or not prompts:
        raise ValueError(f"prompts must be a string, a list of strings, a list of token ids or a list of "
                         f"token-id lists, and not empty; got {prompts!r:.80}")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [list(prompts)]  # one prompt of token ids
    if all(isinstance(p, str) or (isinstance(p, SequenceABC) and not isinstance(p, bytes)) for p in prompts):
        return [p if isinstance(p, str) else list(p) for p in prompts]
    raise ValueError(f"prompts must not mix token ids with other prompts; got {prompts!r:.80}")


def _params_list(params, num_prompts: int) -> list[SamplingParams | None]:
    if params is None or isinstance(params, SamplingParams):
        return [params] * num_prompts
    if isinstance(params, SequenceABC) and not isinstance(params, str):
        if len(params) != num_prompts:
            raise ValueError(f"{len(params)} sampling params for {num_prompts} prompts")
        return list(params)
    raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {type(params).__name__}")


def _resolve_device(device: str | torch.device) -> str:
    device = str(device)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available")
        if device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"
    return device


def _dtype_name(dtype: str | torch.dtype) -> str:
    names = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
    return names.get(dtype, dtype) if isinstance(dtype, torch.dtype) else dtype


def _resolve_max_model_len(max_model_len: int | None, model_config: ModelConfig) -> int:
    limit = model_config.max_position_embeddings
    if max_model_len is None:
        return min(4096, limit)
    if isinstance(max_model_len, int) and max_model_len > limit:
        raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings ({limit})")
    return max_model_len


class _progress:
    """A rich progress bar over finished requests when enabled; yields `advance()`."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total = enabled, total

    def __enter__(self):
        if not self.enabled:
            return lambda: None
        from rich.progress import Progress

        self.bar = Progress()
        self.bar.__enter__()
        task = self.bar.add_task("generating", total=self.total)
        return lambda: self.bar.advance(task)

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.bar.__exit__(*exc)
