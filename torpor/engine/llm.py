"""`LLM`: the offline entry point, `generate(prompts, params) -> [RequestOutput]` (vLLM conventions)."""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
import threading
import time
from collections.abc import Sequence as SequenceABC

import torch

from torpor.engine import phase_times, rpc
from torpor.engine.config import DTYPE_ALIASES, EngineConfig, WeightTransferConfig
from torpor.engine.generation_config import generation_defaults
from torpor.engine.lifecycle import EngineState
from torpor.engine.llm_engine import LLMEngine
from torpor.engine.logprobs import with_logprob_objects
from torpor.engine.model_path import resolve_model
from torpor.engine.model_runner import debug_logging, timed_phase
from torpor.engine.models import ModelConfig
from torpor.engine.outputs import RequestOutput
from torpor.engine.sampling_params import SamplingParams
from torpor.engine.weights.transfer import request_field
from torpor.lazy import collector_paused
from torpor.memory import MemoryManager

Prompt = str | list[int]  # or vLLM's dict prompts: {"prompt": text} / {"prompt_token_ids": [ids]}


def _recording_startup(init):
    """`LLM.__init__` with `startup_phases` kept: seconds per start-up phase (cuda_init, model_build,
    weight_load_plan, kv_cache_sizing, cuda_graph_capture, ..., weight_load_beside: the load's own thread; total),
    what a restart costs instead of a wake (rank 0's, under tensor parallelism)."""

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs) -> None:
        with phase_times.collect() as startup:
            init(self, *args, **kwargs)
        self.startup_phases: dict[str, float] = startup

    return wrapper


class LLM:
    """A paged-KV inference engine on one device, or split over several (tensor_parallel_size).

    model: a Hugging Face checkpoint folder or Hub id ("Qwen/Qwen3-0.6B", resolved through the local
    Hugging Face cache, downloaded when online; see model_path.py); None = the embedded tiny model.
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

    `wait_if_asleep`: seconds `generate` waits for another thread to wake the engine when it does not
    serve (asleep, or weights awaiting reload) before raising RuntimeError naming what to call; the
    default 0 raises at once, since in a single-threaded program nothing else can wake it. None waits
    without limit. `wait_if_paused`: the same while the only reason is `pause_generation` (an RL trainer
    pauses, updates the weights and resumes; requests sent meanwhile wait for the resume); the default is
    `wait_if_asleep`'s value.
    """

    @collector_paused()  # start-up: no full garbage collections over torch's objects (torpor/lazy.py)
    @_recording_startup
    def __init__(self, model: str | None = None, device: str = "auto", dtype: str | torch.dtype = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 256, gpu_memory_utilization: float = 0.9,
                 enforce_eager: bool = False, seed: int = 0, enable_sleep_mode: bool = True, memory=None,
                 worker_memory_options: dict[int, dict] | None = None, wait_if_asleep: float | None = 0.0,
                 wait_if_paused: float | str | None = "wait_if_asleep", **engine_options) -> None:
        debug_logging()
        self.wait_if_asleep = _check_wait(wait_if_asleep, "wait_if_asleep")
        self.wait_if_paused = (self.wait_if_asleep if wait_if_paused == "wait_if_asleep"
                               else _check_wait(wait_if_paused, "wait_if_paused"))
        path = resolve_model(model) if model is not None else _default_model()
        model_config = ModelConfig.from_pretrained(path)
        unknown = sorted(k for k in engine_options if k not in EngineConfig.__dataclass_fields__ or k == "model")
        if unknown:
            raise TypeError(f"unknown LLM option(s): {', '.join(unknown)}")
        if "weight_transfer_config" in engine_options:  # vLLM's dict form too
            engine_options["weight_transfer_config"] = WeightTransferConfig.of(engine_options["weight_transfer_config"])
        if engine_options.get("tokenizer") is not None:
            engine_options["tokenizer"] = resolve_model(engine_options["tokenizer"], "tokenizer")
        with timed_phase("cuda_init"):  # "cuda" resolves to the current device: PyTorch creates the context
            device = _resolve_device(device)
        config = EngineConfig(
            model=path,
            dtype=_dtype_name(dtype),
            device=device,
            max_model_len=_resolve_max_model_len(max_model_len, model_config),
            max_num_seqs=max_num_seqs,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            seed=seed,
            **engine_options,
        )
        self._generation_defaults = generation_defaults(config.generation_config, config.model)
        self._owns_memory = memory is None and enable_sleep_mode  # closed with the LLM (a caller's stays theirs)
        if self._owns_memory:
            with timed_phase("memory_manager"):
                memory = MemoryManager(config.device)
        self.engine = LLMEngine(config, memory, worker_memory_options)
        self.memory = self.engine.memory  # rank 0's; sleep and wake reach every rank through the engine
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        # One engine, many threads: steps, sleeps and wakes take turns; generate waits while asleep.
        self._lock = threading.Condition(threading.RLock())
        self._closed = False
        self._finished: dict[str, RequestOutput] = {}

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, *, request_ids: list[str] | None = None) -> list[RequestOutput]:
        """Complete every prompt (text, token ids, or a dict prompt); outputs in input order, logprobs as
        `{id: Logprob}`. Without `sampling_params`: `get_default_sampling_params()`. `use_tqdm`: a progress
        bar over the finished prompts on stderr, as vLLM shows (only when stderr is a terminal). `request_ids`
        (torpor's; AsyncLLM's `request_id` per prompt): one unique id per prompt, so another thread can
        `abort_requests` them. Raises ValueError before queueing anything if any prompt, parameter or id is
        invalid, RuntimeError if the engine does not serve within `wait_if_asleep` seconds (see the class)."""
        prompt_list = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _params_list(sampling_params, len(prompt_list))
        ids = _request_ids(request_ids, len(prompt_list))
        with self._driving():
            taken = sorted(set(ids) & (set(self.engine.request_ids()) | self._finished.keys())) if request_ids else []
            if taken:
                raise ValueError(f"request_ids: {', '.join(map(repr, taken))} already running in this engine")
            seqs = [self.engine.make_sequence(p, sp, rid) for p, sp, rid in zip(prompt_list, params, ids, strict=True)]
            for seq in seqs:
                self.engine.add_sequence(seq)
        mine = {seq.request_id for seq in seqs}
        outputs: dict[str, RequestOutput] = {}
        try:
            with _progress(use_tqdm, len(seqs)) as advance:
                while len(outputs) < len(seqs):
                    with self._driving():
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
        return [self._for_python(outputs[seq.request_id], seq.sampling_params) for seq in seqs]

    @contextlib.contextmanager
    def _driving(self):
        """The lock, held while this front end drives the engine; refused while a server drives it, or once closed."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine cannot serve any more: it was closed (its memory went back to the "
                                   "device); make a new LLM")
            if self.engine.served_by is not None:
                raise RuntimeError(f"this LLM's engine is served by {self.engine.served_by}, whose thread alone "
                                   f"may drive it: send requests and sleep/wake calls to the server, or stop it first")
            yield

    def _step_or_wait(self) -> None:
        """One engine step, or (not serving) wait up to `wait_if_asleep` for another thread to make the
        engine serve or to end requests (a sleep that aborts them: the next step hands them out). Called
        locked."""
        finished = [o for o in self.engine.step() if o.finished]
        self._finished.update((o.request_id, o) for o in finished)
        if finished:
            self._lock.notify_all()
            return
        start = time.monotonic()
        # (paused for new requests, the running ones still run: step on)
        while not self.engine.serving and not self.engine.has_pending_outputs() and not self.engine.has_work():
            state = self.engine.state()  # the limit follows the reason: a pause may turn into a sleep
            limit = self.wait_if_paused if state.only_paused else self.wait_if_asleep
            left = None if limit is None else start + limit - time.monotonic()
            if left is not None and left <= 0:
                waited = f" (waited {limit:g} s)" if limit else ""
                raise RuntimeError(f"generate: {state.not_serving_reason()}{waited}")
            self._lock.wait(left)

    @property
    def state(self) -> EngineState:
        """The engine's `EngineState`: serving, sleep level, weights validity, per-tag state."""
        with self._driving():
            return self.engine.state()

    # ---- sleep mode --------------------------------------------------------------------------
    def sleep(self, level: int = 1, mode: str = "wait"):
        """Level 0: pause scheduling. Level 1: weights and runtime state to host memory, KV cache
        and scratch discarded. Level 2: as 1, but the weights are discarded too (then
        `reload_weights` or `update_weights`). Levels 3 and 4: as 1 and 2, plus this process's whole CUDA
        context released (0 MiB of device memory; CUDA, one GPU per process, driver >= 570; see
        docs/sleep-mode.md). `mode`: "wait" lets running requests finish first, "abort" ends them, "keep" keeps
        them (they continue after the wake; vLLM's default is "abort"). Returns the memory report (None for a
        no-op or level 0). A sleep that fails leaves the engine as it was."""
        with self._driving():
            report = self.engine.sleep(level, mode)
            self._lock.notify_all()
            return report

    def wake_up(self, tags: list[str] | None = None):
        """Wake the named tags (all when None); every wake also restores the runtime state. Requests
        waiting in `generate` run once every tag is awake. Returns a `WakeResult`."""
        with self._driving():
            result = self.engine.wake_up(tags)
            self._lock.notify_all()
            return result

    def is_sleeping(self) -> bool:
        with self._driving():
            return self.engine.is_sleeping()

    # ---- pause and resume (vLLM's names; see LLMEngine.pause_generation) -----------------------
    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause generation (call it from another thread than `generate`'s, which waits meanwhile when
        `wait_if_paused` allows): "abort" every request, "wait" for the running ones, "keep" them (frozen with
        their KV; `clear_cache` recomputes them after the resume), or SGLang's "retract" / "in_place"."""
        with self._driving():
            self.engine.pause_generation(mode, clear_cache)
            self._lock.notify_all()

    def resume_generation(self) -> None:
        with self._driving():
            self.engine.resume_generation()
            self._lock.notify_all()

    def is_paused(self) -> bool:
        with self._driving():
            return self.engine.is_paused()

    def abort_requests(self, request_ids: list[str] | None = None) -> int:
        """Abort the given requests (None: every one), without pausing; `generate` returns their outputs,
        finish_reason "abort" with the tokens they have. Returns how many were aborted."""
        with self._driving():
            count = len(self.engine.abort_requests(request_ids))
            self._lock.notify_all()
            return count

    def update_weight_version(self, new_version: str) -> None:
        """Label the weights served (vLLM's; the weights are not touched): tokens sampled from now on carry it
        (`CompletionOutput.weight_versions`)."""
        with self._driving():
            self.engine.update_weight_version(new_version)

    def get_weight_version(self) -> str:
        return self.engine.weight_version

    def reload_weights(self, path: str | None = None) -> None:
        """Reload the checkpoint (or the one at `path`) into the same weight tensors."""
        with self._driving():
            self.engine.reload_weights(path)
            self._lock.notify_all()

    def update_weights(self, named_tensors) -> int:
        """Copy `(hf_name, tensor)` pairs into the weights (all of them after a level-2 sleep). vLLM's form too: a
        request `{"update_info": {...}}` (or an object with `update_info`) is one chunk of the four-phase update
        (`start_weight_update` first; see `init_weight_transfer_engine`). Returns the count."""
        with self._driving():
            if isinstance(named_tensors, dict) or hasattr(named_tensors, "update_info"):
                count = self.engine.update_weights_transfer(request_field(named_tensors, "update_info"))
            else:
                count = self.engine.update_weights(named_tensors)
            self._lock.notify_all()
            return count

    # ---- vLLM's native weight transfer (engine/weights/transfer.py; docs/rl.md) -----------------
    def init_weight_transfer_engine(self, request) -> None:
        """`{"init_info": {...}}` (or vLLM's WeightTransferInitRequest), once, for the backend of
        `weight_transfer_config`: "ipc" takes `{}`; "nccl" joins the trainer's group (`master_address`,
        `master_port`, `rank_offset`, `world_size`; the trainer, rank 0, forms it meanwhile)."""
        with self._driving():
            self.engine.init_weight_transfer_engine(request_field(request, "init_info"))

    def start_weight_update(self, include_draft: bool = False, is_checkpoint_format: bool = True) -> None:
        """Begin one update: nothing runs until `finish_weight_update` (generate waits, as while asleep)."""
        with self._driving():
            self.engine.start_weight_update(include_draft, is_checkpoint_format)

    def start_draft_weight_update(self) -> None:
        """vLLM's update of a speculative-decoding draft model: this engine has none."""
        raise ValueError("start_draft_weight_update: this engine has no draft model")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """The update commits: the new weights serve, labelled `weight_version` when given."""
        with self._driving():
            self.engine.finish_weight_update(weight_version)
            self._lock.notify_all()

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """SGLang's Engine.get_weights_by_name: the checkpoint tensor as the engine holds it (float32 values), its
        first `truncate_size` rows."""
        with self._driving():
            return self.engine.get_weights_by_name(name, truncate_size)

    def memory_usage(self) -> dict:
        """Per-tag bytes and states, the sleep level, device memory in use (rank 0's device); under
        tensor parallelism also "ranks": each rank's device, its memory in use and its tags."""
        with self._driving():
            return self.engine.memory_usage()

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, free the CUDA graphs, the GEMM workspace and the update groups,
        and give the weights', the KV cache's and the runtime state's memory back to the device now (with the memory
        manager the LLM made; one passed in as `memory` stays the caller's), not when the LLM is collected; the LLM
        cannot generate afterwards (generate then raises). The one call that proceeds while a server serves the engine
        (a shutdown must always be able to give its resources back: stop the server first)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self.engine.close()
            finally:
                # The modules' parameters refer back to their modules (weight loaders): cycles, which only the
                # collector frees, before their pools can go.
                gc.collect()
                if self._owns_memory and self.memory is not None:
                    self.memory.close()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()

    # ---- vLLM's surface ---------------------------------------------------------------------
    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation ([{"role": ..., "content": ...}]) or a list of them,
        rendered with the checkpoint's chat template (or `chat_template`, Jinja text) as Hugging Face
        renders it; `chat_template_kwargs` reach the template (e.g. {"enable_thinking": False}). Each
        output's `prompt` is the rendered text. ValueError (naming the template error) before anything
        is queued if a conversation cannot be rendered."""
        conversations = messages if messages and isinstance(messages, list) and all(
            isinstance(m, list) for m in messages) else [messages]
        texts = [self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
            continue_final_message=continue_final_message, tools=tools, **(chat_template_kwargs or {}))
            for conversation in conversations]
        prompts = [{"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)} for text in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        for output, text in zip(outputs, texts, strict=True):
            output.prompt = text
        return outputs

    def get_tokenizer(self):
        """The engine's `Tokenizer` (encode, decode, apply_chat_template, eos_token_id, ...)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (EngineConfig.generation_config)."""
        return SamplingParams(**self._generation_defaults)

    def collective_rpc(self, method, args: tuple | list = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list:
        """vLLM's `collective_rpc`: one result per rank. The engine's own operations by name ("sleep", "wake_up",
        "reload_weights", "update_weights", "is_sleeping", "memory_usage", the weight-update calls: see rpc.py) run
        once and reach every rank themselves, so each entry is that result; any other name is a Worker method that
        the Worker offers (its readings and a worker extension's methods, `worker_extension_cls`), and a callable is
        called with each rank's Worker first, on every rank (under tensor parallelism sent by value: cloudpickle).
        What an extension gives `Worker.write_weights` is written through the engine's rule after the call
        (`LLMEngine.worker_rpc`). ValueError names an unknown method or bad arguments."""
        if isinstance(method, str) and method in rpc.METHODS:
            result = rpc.call(self, method, args, kwargs)
            return [result] * self.config.tensor_parallel_size
        with self._driving():
            results = self.engine.worker_rpc(method, tuple(args), kwargs, timeout)
            self._lock.notify_all()
            return results

    def _for_python(self, output: RequestOutput, params: SamplingParams) -> RequestOutput:
        """`output` with `{id: Logprob}` logprobs (vLLM's shape) when any were asked for."""
        if params.logprobs is None and params.prompt_logprobs is None:
            return output

        return with_logprob_objects(output, self.tokenizer, params.logprobs, params.prompt_logprobs)
    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every KV block cached for prefix reuse (vLLM's name); True when done. `reset_running_requests`:
        the running requests recompute their KV (they go back to the waiting queue first); `reset_connector`:
        accepted (torpor has no external KV connector)."""
        with self._driving():
            return self.engine.reset_prefix_cache(reset_running_requests)
    # ---- weights from a trainer process (SGLang's names; see weights/receiver.py) --------------
    def update_weights_from_tensor(self, named_tensors=None, load_format: str | None = None,
                                   flush_cache: bool = True, serialized_named_tensors: list[str] | None = None) -> int:
        """New weights by reference: `named_tensors` ((name, tensor) pairs, or with load_format
        "flattened_bucket" a {"flattened_tensor", "metadata"} dict, or a list of such buckets), or SGLang's
        `serialized_named_tensors` (base64 ForkingPickler payloads, one per rank; CUDA IPC or shared memory).
        Checked before anything is written; returns the number of tensors loaded."""
        with self._driving():
            count = self.engine.update_weights_from_tensor(serialized_named_tensors, load_format, flush_cache,
                                                           named_tensors)
            self._lock.notify_all()
            return count

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str | None = None,
                                  timeout: float = 120.0) -> None:
        """Join the trainer's process group `group_name` as rank `rank_offset` (+ tp rank), gloo or NCCL."""
        with self._driving():
            self.engine.init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name,
                                                  backend, timeout)

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True) -> int:
        """Receive the trainer's rank-0 broadcast of each named tensor, in order, then load them all."""
        with self._driving():
            count = self.engine.update_weights_from_distributed(names, dtypes, shapes, group_name, flush_cache)
            self._lock.notify_all()
            return count

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        with self._driving():
            self.engine.destroy_weights_update_group(group_name)

def _prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    if isinstance(prompts, SequenceABC) and any(isinstance(p, dict) for p in prompts):
        return [_dict_prompt(p, i) for i, p in enumerate(prompts)]
    if not isinstance(prompts, SequenceABC) or not prompts:
        raise ValueError(f"prompts must be a string, a list of strings, a list of token ids or a list of "
                         f"token-id lists, and not empty; got {prompts!r:.80}")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [list(prompts)]  # one prompt of token ids
    if all(isinstance(p, str) or (isinstance(p, SequenceABC) and not isinstance(p, bytes)) for p in prompts):
        return [p if isinstance(p, str) else list(p) for p in prompts]
    raise ValueError(f"prompts must not mix token ids with other prompts; got {prompts!r:.80}")


def _dict_prompt(prompt, index: int) -> Prompt:
    """vLLM's TextPrompt / TokensPrompt: exactly one of "prompt" (text) or "prompt_token_ids"."""
    if not isinstance(prompt, dict):
        raise ValueError(f"prompts[{index}]: a list of dict prompts must hold only dicts, got {prompt!r:.60}")
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
    if unknown or len(prompt) != 1:
        raise ValueError(f"prompts[{index}] must have exactly one of the keys 'prompt' (text) or 'prompt_token_ids'; "
                         f"got {sorted(prompt)}" + (f" (not supported: {unknown})" if unknown else ""))
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"prompts[{index}]['prompt'] must be a string, got {type(prompt['prompt']).__name__}")
        return prompt["prompt"]
    ids = prompt["prompt_token_ids"]
    if isinstance(ids, str | bytes) or not isinstance(ids, SequenceABC):
        raise ValueError(f"prompts[{index}]['prompt_token_ids'] must be a list of token ids, got {ids!r:.60}")
    return list(ids)


def _params_list(params, num_prompts: int) -> list[SamplingParams | None]:
    if params is None or isinstance(params, SamplingParams):
        return [params] * num_prompts
    if isinstance(params, SequenceABC) and not isinstance(params, str):
        if len(params) != num_prompts:
            raise ValueError(f"{len(params)} sampling params for {num_prompts} prompts")
        return list(params)
    raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {type(params).__name__}")


def _default_model() -> str:
    """The embedded tiny model's folder (the checkpoint generator is imported only for it)."""
    from torpor.synthetic import default_model_path

    return str(default_model_path())


def _request_ids(request_ids: list[str] | None, count: int) -> list[str | None]:
    """One id per prompt (None: the engine numbers them), each a non-empty string, none twice."""
    if request_ids is None:
        return [None] * count
    if not isinstance(request_ids, list | tuple) or len(request_ids) != count:
        raise ValueError(f"request_ids must be a list of one id per prompt ({count}), got {request_ids!r}")
    bad = [r for r in request_ids if not isinstance(r, str) or not r]
    if bad:
        raise ValueError(f"request_ids must be non-empty strings, got {bad[0]!r}")
    if len(set(request_ids)) != count:
        raise ValueError("request_ids: an id appears twice")
    return list(request_ids)


def _check_wait(seconds: float | None, name: str) -> float | None:
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds < float("inf"):
        raise ValueError(f"{name} must be a number of seconds >= 0 or None (no limit), got {seconds!r}")
    return float(seconds)


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
    return names.get(dtype, dtype) if isinstance(dtype, torch.dtype) else DTYPE_ALIASES.get(dtype, dtype)


def _resolve_max_model_len(max_model_len: int | None, model_config: ModelConfig) -> int:
    limit = model_config.max_position_embeddings
    if max_model_len is None:
        return min(4096, limit)
    if isinstance(max_model_len, int) and max_model_len > limit:
        raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings ({limit})")
    return max_model_len


class _progress:
    """A rich progress bar over finished requests on stderr when enabled and stderr is a terminal (a log
    file or a pipe gets none); yields `advance()`."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total = enabled and sys.stderr.isatty(), total

    def __enter__(self):
        if not self.enabled:
            return lambda: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self.bar = Progress("Processed prompts", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=Console(stderr=True))
        self.bar.__enter__()
        task = self.bar.add_task("generate", total=self.total)
        return lambda: self.bar.advance(task)

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.bar.__exit__(*exc)
