"""The engine loop: requests in, one scheduled batch per `step`, outputs (with their text) out; sleep, wake and
every write to the weights.

`LLMEngine` holds a tokenizer, an `Executor` (one `Worker` per rank: the model, its memory, its device state),
the `Scheduler`, the `Lifecycle` (the one owner of serving / asleep / paused / weights-whole state, which the
scheduler asks whether to step) and the `WeightReceiver` (every write to the weights). Both front ends, `LLM` and
the server's `AsyncEngine`, call only its public methods. Output text is built here too, once per request
(`tokenizer.OutputText`): streamed deltas already respect stop strings.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

from torpor.engine.config import EngineConfig
from torpor.engine.executor import Executor, make_executor
from torpor.engine.lifecycle import (
    EngineState,
    Lifecycle,
    LifecycleError,
    SleepPlan,
    check_mode,
    check_pause_mode,
    check_tags,
)
from torpor.engine.model_runner import debug_logging, timed_phase
from torpor.engine.outputs import RequestOutput
from torpor.engine.rpc import METHODS, RPCArgumentError, public_methods
from torpor.engine.sampling_params import OutOfVocabulary, SamplingParams
from torpor.engine.scheduler import Scheduler
from torpor.engine.sequence import FINISHED, Sequence
from torpor.engine.tokenizer import OutputText, Tokenizer
from torpor.engine.weights.manifest import Manifest
from torpor.engine.weights.receiver import PushPosition, WeightReceiver, check_version, weight_names
from torpor.engine.weights.transfer import WeightTransfer
from torpor.engine.weights.updates import EXTENSION
from torpor.engine.worker import Worker
from torpor.lazy import collector_paused
from torpor.memory import CheckpointError as ContextCheckpointError
from torpor.memory import CheckpointUnsupportedError, Report

logger = logging.getLogger("torpor.engine")
DEFAULT_GROUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class WakeResult:
    """What a `wake_up` did: the memory report, which tags woke, whether the engine serves, and the seconds of the
    whole wake (the context's restore included)."""

    report: Report | None
    woken: tuple[str, ...]
    serving: bool
    seconds: float = 0.0


class RequestError(ValueError):
    """A request the engine refuses. `field`: the part at fault ("prompt", "max_tokens", "sampling_params",
    "request_id"); `code`: a machine-readable reason where one helps a client (context_length_exceeded)."""

    def __init__(self, message: str, field: str, code: str | None = None) -> None:
        super().__init__(message)
        self.field, self.code = field, code


@dataclass
class _Request:
    """The engine's side of one request: its n samples (index order), their texts, and how much of each was
    handed out."""

    samples: list[Sequence]
    texts: list[OutputText]
    stream: bool                  # hand out an output every step the request gains tokens
    num_tokens_out: list[int]     # per sample: output tokens already handed out

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.samples)

    @property
    def incremental(self) -> bool:
        """Whether its texts are detokenized as tokens come (streamed, or stop strings): the samples share
        their options, so all are or none is."""
        return self.texts[0].incremental


def _text_token_ids(seq: Sequence) -> list[int]:
    """The output tokens its text is made of: all but the eos or stop_token_ids token that ended it, unless
    include_stop_str_in_output (vLLM: that token stays in token_ids, its text, e.g. "<|im_end|>" with
    skip_special_tokens=False, is not output text). The scheduler has finished such a sequence before
    its text is updated; one ended by a stop string has a string stop_reason."""
    ids = seq.output_token_ids
    stopped_by_token = seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
    return ids[:-1] if stopped_by_token and not seq.sampling_params.include_stop_str_in_output else ids


class LLMEngine:
    """Tokenizer, executor, scheduler, lifecycle and weight receiver; detokenizes outputs, applies stop strings,
    sleeps and wakes."""

    @collector_paused()  # start-up: no full garbage collections over torch's objects (torpor/lazy.py)
    def __init__(self, config: EngineConfig, memory=None, worker_memory_options: dict[int, dict] | None = None,
                 worker_cls: type[Worker] = Worker) -> None:
        """`memory`: rank 0's MemoryManager (None: no sleep mode); `worker_memory_options` (tensor parallel only):
        rank -> MemoryManager kwargs of that worker; `worker_cls`: the Worker class of every rank (a worker
        extension mixed in)."""
        debug_logging()
        with timed_phase("tokenizer"):
            self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or config.model)
        self.executor: Executor = make_executor(config, memory, worker_memory_options, worker_cls)
        driver = self.executor.driver
        self.memory = memory  # rank 0's (the queries read it; sleep and wake reach every rank through the executor)
        self.config = self.executor.config  # with the profiled number of KV blocks
        self.model_config = model_config = driver.runner.model_config
        self.vocab_size = model_config.vocab_size
        ignored = driver.runner.model.ignored_weights()  # (holds not the model: `close` frees its weights)
        # dummy weights: the checkpoint the config describes (vLLM's RL start: dummy weights, then the trainer's)
        manifest = (Manifest.of_config(model_config) if config.load_format == "dummy"
                    else Manifest.of_checkpoint(config.model))
        names = weight_names(manifest, ignored)
        tags = memory.tags() if memory is not None else []
        self.lifecycle = Lifecycle(tags, names)
        self.scheduler = Scheduler(self.config, model_config.eos_token_ids, self.lifecycle)
        # (the block manager's own reset: a bound method of the engine would make a reference cycle, and a dropped
        # engine would then give its memory back only at the next garbage collection)
        self.weights = WeightReceiver(self.executor, self.lifecycle, manifest, ignored,
                                      self.scheduler.block_manager.reset_prefix_cache)
        self.transfer = WeightTransfer(self.config.weight_transfer_config, self.weights, self.executor)
        self._pending: list[RequestOutput] = []  # produced outside `step` (drained or aborted by a sleep)
        self._requests: dict[str, _Request] = {}
        self._request_ids = itertools.count()
        # Who drives this engine besides its own caller: set while a server's engine thread owns it (that
        # thread alone may then step it, or another driver would take its outputs); `LLM` refuses meanwhile.
        self.served_by: str | None = None
        self.host_reservation = self._reserve_host_copies()

    # ---- requests ----------------------------------------------------------------------
    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None) -> Sequence:
        """A validated request (not queued yet): the one place a request is checked; ValueError names
        what is wrong with it (the server answers 400 with its text)."""
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}",
                               "sampling_params")
        try:
            params.check_vocab(self.vocab_size)
        except OutOfVocabulary as exc:
            raise RequestError(str(exc), exc.field) from None
        if params.return_routed_experts and not self.model_config.is_moe:
            raise RequestError(f"return_routed_experts needs a mixture-of-experts model; "
                               f"{self.model_config.architecture} has no routed experts",
                               "return_routed_experts")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise RequestError(f"request_id must be a non-empty string, got {request_id!r}", "request_id")
        token_ids, text = self._prompt_tokens(prompt)
        max_len = self.config.max_model_len
        if len(token_ids) >= max_len:
            raise RequestError(f"the prompt has {len(token_ids)} tokens; it must be shorter than max_model_len "
                               f"({max_len}) to leave room for an output token", "prompt", "context_length_exceeded")
        if len(token_ids) + params.max_tokens > max_len:
            raise RequestError(
                f"the prompt has {len(token_ids)} tokens and max_tokens is {params.max_tokens}: together "
                f"{len(token_ids) + params.max_tokens}, beyond max_model_len ({max_len}); shorten the prompt or "
                f"ask for at most {max_len - len(token_ids)} tokens", "max_tokens", "context_length_exceeded")
        try:
            self.scheduler.check_n(params.n, len(token_ids))
        except ValueError as exc:
            raise RequestError(str(exc), "n") from None
        request_id = str(next(self._request_ids)) if request_id is None else request_id
        return Sequence(request_id, token_ids, params, text)

    def _prompt_tokens(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is an empty string", "prompt")
            token_ids, text = self.tokenizer.encode(prompt), prompt
        elif isinstance(prompt, list | tuple):
            token_ids, text = list(prompt), None
            bad = [t for t in token_ids
                   if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"prompt token ids must be ints in [0, {self.vocab_size}) (the vocabulary), "
                                   f"got {bad[:5]}", "prompt")
        else:
            raise RequestError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}", "prompt")
        if not token_ids:
            raise RequestError("the prompt has no tokens", "prompt")
        return token_ids, text

    def add_sequence(self, seq: Sequence, stream: bool = False) -> str:
        """Queue a sequence from `make_sequence` (with n > 1 its other samples are made here). With `stream`,
        `step` hands out an output (text and token deltas) every step the request gains tokens; otherwise
        only once all its samples are finished."""
        samples = self.scheduler.add(seq)
        texts = [OutputText(self.tokenizer, sample.sampling_params, stream) for sample in samples]
        self._requests[seq.request_id] = _Request(samples, texts, stream, [0] * len(samples))
        return seq.request_id

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, stream: bool = False) -> str:
        """Queue a request (text or token ids); returns its id."""
        return self.add_sequence(self.make_sequence(prompt, params, request_id), stream)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a waiting or running request; returns its output (finish_reason 'abort')."""
        self.scheduler.abort(request_id)
        request = self._requests.pop(request_id, None)
        return None if request is None else self._output(request)

    def request_ids(self) -> list[str]:
        """The ids of the requests waiting or running (in arrival order)."""
        return list(self._requests)

    def abort_requests(self, request_ids: Iterable[str] | None = None) -> list[RequestOutput]:
        """Abort the given requests (None: every one, waiting or running); their outputs, finish_reason 'abort' with
        the tokens and logprobs they have, are returned and also handed out by the next `step`."""
        ids = list(self._requests) if request_ids is None else [r for r in request_ids if r in self._requests]
        outputs = [output for output in map(self.abort_request, ids) if output is not None]
        self._pending += outputs
        return outputs

    @property
    def weight_version(self) -> str:
        """The label of the weights served (set by an update that names one, or `update_weight_version`)."""
        return self.weights.version

    def update_weight_version(self, version: str) -> None:
        """Set the label of the weights served (the weights are not touched); tokens sampled from the next step
        on carry it."""
        self.weights.set_version(version)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached KV block (blocks in use stay with their sequences; they register nothing
        more). Done by the engine itself whenever the weights change or the KV cache is discarded.
        `reset_running_requests` (vLLM's): the running requests go back to the waiting queue first, their KV
        dropped (recomputed when they start again). Always done: True."""
        if reset_running_requests:
            self.scheduler.retract()
        self.scheduler.block_manager.reset_prefix_cache()
        return True

    # ---- pause and resume (vLLM's and SGLang's pause_generation; the state: Lifecycle.paused) -----------
    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause generation; requests added meanwhile wait until `resume_generation`. `mode`: "abort" every
        request (running and waiting: their outputs, finish_reason "abort", keep their tokens and logprobs);
        "wait": no request starts, and the call returns once the running ones finished (stepped here; their
        outputs come out of the next `step`); "keep" (SGLang's "in_place"): nothing runs, running requests keep
        their KV and continue after the resume; "retract": nothing runs, running requests go back to the waiting
        queue, their KV dropped and recomputed after the resume. `clear_cache` (vLLM's): once idle the prefix cache
        is reset; with "keep" the running requests are retracted first, so after a weight update they recompute
        under the new weights (with clear_cache=False they keep the KV of their earlier tokens, computed by the
        old ones). A pause while paused changes its mode. Raises LifecycleError, changing nothing, for "wait"
        while the running requests cannot run (asleep, weights not whole)."""
        if not self.begin_pause(mode, clear_cache):
            self._drain_running("pause_generation(mode='wait')")
            self.finish_pause(clear_cache)

    def begin_pause(self, mode: str, clear_cache: bool = True) -> bool:
        """What `pause_generation` does at once; returns whether the pause is complete (False: mode "wait" with
        requests running: call `finish_pause` once none runs). The server's engine thread steps meanwhile."""
        mode, lc = check_pause_mode(mode), self.lifecycle
        if mode == "wait" and self.scheduler.running and not lc.may_run(ignore_pause=True):
            raise LifecycleError(f"pause_generation(mode='wait'): the running requests cannot finish now: "
                                 f"{self.state().not_serving_reason()}; use mode 'abort' or 'keep'")
        if mode == "abort":
            self.abort_requests(None)
        lc.pause("new" if mode in ("abort", "wait") else "all")
        if mode == "retract" or (clear_cache and mode in ("keep", "in_place")):
            self.scheduler.retract()
        if mode == "wait" and self.scheduler.running:
            return False
        self.finish_pause(clear_cache)
        return True

    def finish_pause(self, clear_cache: bool = True) -> None:
        """The end of a pause once no request runs: the prefix cache reset when `clear_cache`."""
        if clear_cache:
            self.reset_prefix_cache()

    def resume_generation(self, empty_cache: bool = False) -> None:
        """End a pause: requests waiting (new, kept, retracted) run again. `empty_cache` (SGLang's
        torch_empty_cache): give the device's cached free memory back first (CUDA)."""
        if empty_cache and self.executor.driver.device.type == "cuda":
            torch.cuda.empty_cache()
        self.lifecycle.resume()

    def is_paused(self) -> bool:
        """Whether generation is paused (`pause_generation`; a level-0 sleep is `is_sleeping`)."""
        return self.lifecycle.paused is not None

    def prefix_cache_stats(self) -> dict[str, int]:
        """Prompt tokens looked up in the prefix cache and found there (counters since start-up)."""
        bm = self.scheduler.block_manager
        return {"queries": bm.num_queried_tokens, "hits": bm.num_hit_tokens}

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def has_pending_outputs(self) -> bool:
        """Whether outputs made outside `step` (requests a sleep finished or aborted) wait for the next
        `step`, which hands them out even while the engine does not serve."""
        return bool(self._pending)

    def has_work(self) -> bool:
        """Whether `step` would run something: a request runs, or waits and may start."""
        return self.scheduler.has_runnable()

    def close(self) -> None:
        """Stop every rank (the tensor-parallel workers too), free the CUDA graphs, the GEMM workspace and the update
        groups; the engine cannot run afterwards."""
        self.executor.close()

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list:
        """A Worker method (by name, worker extensions' included) or a function of the Worker, on every rank; one
        result per rank."""
        return self.executor.collective_rpc(method, tuple(args), kwargs, timeout)

    def worker_rpc(self, method, args: tuple = (), kwargs: dict | None = None, timeout: float | None = None) -> list:
        """vLLM's collective_rpc from outside the engine (LLM.collective_rpc, POST /collective_rpc): a callable of
        the Worker, or a method name the Worker offers (its readings, a worker extension's methods; the rest are the
        engine's own operations), on every rank; one result per rank. What the call gave `Worker.write_weights` on
        every rank is then written through the WeightReceiver, as one update (or as part of the four-phase update
        in progress), or not at all."""
        if not callable(method):
            offered = public_methods(type(self.executor.driver))
            if method not in offered:
                raise RPCArgumentError(f"unknown collective_rpc method {method!r}; supported: the engine's "
                                       f"{sorted(METHODS)} and the Worker's {sorted(offered)} (a worker extension "
                                       "adds its methods: worker_extension_cls)", "method")
        try:
            results = self.executor.collective_rpc(method, tuple(args), kwargs, timeout)
        except BaseException:
            self.executor.collective_rpc("drop_staged", (EXTENSION,))
            raise
        self._write_extension_weights()
        return results

    def _write_extension_weights(self) -> None:
        """What a worker extension gave `Worker.write_weights` in the call that just ended, written on every rank."""
        names = self.executor.collective_rpc("staged_names", (EXTENSION,))
        if not any(names):
            return
        if any(n != names[0] for n in names):
            self.executor.collective_rpc("drop_staged", (EXTENSION,))
            counts = [len(n) for n in names]
            raise ValueError(f"the worker extension gave the ranks different weights to write ({counts} tensors by "
                             "rank): nothing was written")
        push = self.transfer.next_push()
        self.weights.apply_opened(names[0], EXTENSION, push, flush_cache=push is None)

    # ---- vLLM's native weight transfer (weights/transfer.py) ---------------------------------
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.transfer.init(init_info)

    def start_weight_update(self, include_draft: bool = False, is_checkpoint_format: bool = True) -> None:
        self.transfer.start(include_draft, is_checkpoint_format)

    def update_weights_transfer(self, update_info: dict) -> int:
        """One chunk of the four-phase update (vLLM's update_weights), blocking until it is received and copied."""
        return self.transfer.update(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.transfer.finish(weight_version)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return self.weights.read(name, truncate_size, self.executor.driver.runner.model)

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule a batch, run it, record the tokens; returns the outputs of this step (finished requests, and
        streamed ones that gained tokens) and any a sleep produced meanwhile. Runs nothing unless the lifecycle
        lets the scheduler run."""
        self._check_health()
        outputs, self._pending = self._pending, []
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return outputs
        output = self.executor.execute_model(seqs, is_prefill)
        self.scheduler.postprocess(seqs, output.token_ids, output.logprobs, output.routed_experts, self.weights.version)
        return outputs + self._outputs(seqs)

    def _outputs(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """Detokenize what `seqs` gained, end those that reached a stop string, and snapshot the finished
        and the streamed ones. (Per-request work, not per-sequence, where it can be: a request's samples
        share its text options, and only one with a sample finished now can have finished.)"""
        requests = self._requests
        touched = {}  # the requests this step advanced, in batch order (aborted ones, gone, left out)
        for request_id in dict.fromkeys([seq.request_id for seq in seqs]):
            request = requests.get(request_id)
            if request is not None:
                touched[request_id] = request
        if any(request.incremental for request in touched.values()):
            self._update_texts(seqs, touched)
        finished_now = {seq.request_id for seq in seqs if seq.status is FINISHED}
        outputs = []
        for request_id, request in touched.items():
            if request_id in finished_now and request.finished:
                del requests[request_id]
                outputs.append(self._output(request))
            elif request.stream:
                outputs.append(self._output(request))
        return outputs

    def _update_texts(self, seqs: list[Sequence], touched: dict[str, _Request]) -> None:
        """Detokenize the new tokens of the incremental texts, in batch order; a stop string ends its sample."""
        for seq in seqs:
            request = touched.get(seq.request_id)
            if request is None or not request.incremental:
                continue
            # (only incremental texts read the tokens: the slice is not made for the others, every step)
            stop = request.texts[seq.index].update(_text_token_ids(seq))
            if stop is not None:
                if seq.is_finished:  # ended by this token anyway (eos, length): the stop string names it
                    seq.finish_reason, seq.stop_reason = "stop", stop
                else:
                    self.scheduler.finish(seq, "stop", stop)

    @staticmethod
    def _output(request: _Request) -> RequestOutput:
        """A snapshot of every sample: the whole text so far and, streaming, what is new since the last one."""
        wholes, deltas, starts = [], [], []
        for i, (seq, text) in enumerate(zip(request.samples, request.texts, strict=True)):
            if seq.is_finished:
                whole = text.final(_text_token_ids(seq))
                delta = text.delta(whole)
            else:
                delta = text.delta()
                whole = text.text[:text.num_emitted]
            wholes.append(whole)
            deltas.append(delta)
            starts.append(request.num_tokens_out[i])
            request.num_tokens_out[i] = seq.num_output_tokens
        return RequestOutput.from_sequences(request.samples, wholes, deltas, starts)

    # ---- state -------------------------------------------------------------------------
    @property
    def serving(self) -> bool:
        """Requests run: awake, every tag awake, the weights whole, no update in progress, not paused."""
        self._check_health()
        return self.lifecycle.serving

    def is_sleeping(self) -> bool:
        return self.lifecycle.level is not None

    def state(self) -> EngineState:
        """Serving, sleep level, weights, per-tag state and the queue, read together."""
        self._check_health()
        return self.lifecycle.state(len(self.scheduler.running), len(self.scheduler.waiting))

    def health(self) -> str | None:
        """Why the engine cannot serve now (a dead or stopped tensor-parallel worker), or None."""
        self._check_health()
        return self.lifecycle.broken or self.executor.health()

    def _check_health(self) -> None:
        broken = self.executor.broken()
        if broken is not None:
            self.lifecycle.break_(broken)

    def memory_usage(self) -> dict:
        """Per-tag bytes and states, the sleep level, the device memory in use (rank 0's device); under tensor
        parallelism also "ranks": each rank's device, its memory in use and its tags."""
        if self.memory is None:
            raise LifecycleError("sleep mode is off: build the engine with a MemoryManager (enable_sleep_mode)")
        tags = {tag: asdict(usage) for tag, usage in self.memory.usage().items()}
        reservation, lc = self.host_reservation, self.lifecycle
        usage = {"level": lc.level, "device_used_bytes": self.memory.device_used_bytes(),
                 "weights_discarded": not lc.weights_whole, "context_released": lc.context_released,
                 "host_backup_bytes": sum(t["host_backup_bytes"] for t in tags.values()),
                 "host_reservation": None if reservation is None else
                 {"done": reservation.done, "reserved_bytes": reservation.reserved_bytes,
                  "error": None if reservation.error is None else str(reservation.error)},
                 "tags": tags}
        if self.executor.world_size > 1:
            usage["ranks"] = self.executor.collective_rpc("info")
        return usage

    # ---- sleep and wake (the levels and the tag table: lifecycle.py) ----------------------
    def sleep(self, level: int = 1, mode: str = "wait") -> Report | None:
        """Level 0 pauses scheduling; 1 and 2 also release memory; 3 and 4 are 1 and 2 plus the CUDA context.
        Running requests are finished first (`mode="wait"`, new ones are not started), aborted (`"abort"`; their
        outputs come out of the next `step`) or kept (`"keep"`: at level 0 frozen with their KV, deeper back to the
        waiting queue, recomputed after the wake). A sleep that deepens nothing is a no-op (None). A sleep that
        fails leaves the engine as it was before (same level, serving if it served); level 3/4's preconditions are
        checked before anything is touched. A weight update in progress ends first, as a failure (its old weights
        come back when they can)."""
        check_mode(mode)
        lc = self.lifecycle
        plan = lc.plan_sleep(level)
        if plan is None:
            return None
        self._check_no_receive("sleep")
        self._check_settle(mode, f"sleep(level={level}, mode='wait')")
        if plan.release_context and not lc.context_released:
            self._check_context_release(level)
        if plan.actions and not lc.context_released:
            self.executor.driver.check_sleep(plan.actions)  # a sleep bound to fail must not abort requests first
        return self._sleep(plan, mode)

    def release_tags(self, tags: Iterable[str], mode: str = "wait") -> Report | None:
        """Release only `tags`, each with its level-1 action (SGLang's `release_memory_occupation`): the engine
        pauses as at level 1 and a `wake_up` naming them (or all) restores them. Tags that do not exist on this
        device or already sleep are skipped; None when nothing is released."""
        check_mode(mode)
        plan = self.lifecycle.plan_release(check_tags(list(tags)))
        if plan is None:
            return None
        self._check_no_receive("release_memory_occupation")
        self._check_settle(mode, "release_memory_occupation")
        self.executor.driver.check_sleep(plan.actions)
        return self._sleep(plan, mode)

    def _sleep(self, plan: SleepPlan, mode: str) -> Report | None:
        lc, before = self.lifecycle, self.lifecycle.level
        with self.weights.held(drop=plan.drops_weights):
            self.weights.abandon(None, "a sleep came before the update ended")
            try:
                if lc.level in (None, 0):  # requests may be running
                    self._settle_running(mode, plan.level)
                if lc.context_released and plan.actions:
                    self._restore_context()  # dropping host copies needs the context
                report = self.executor.sleep(plan.actions) if plan.actions else None
            except BaseException:
                # The failed sleep may have discarded the KV cache before it rolled back (zeroed blocks): the prefix
                # cache must not serve them. Nothing runs now (running requests were settled above).
                self.reset_prefix_cache()
                lc.end_drain()
                raise
            lc.slept(plan)
            if self.memory is not None and self.memory.device.type == "cuda" and plan.actions:
                torch.cuda.empty_cache()  # the steps' cached temporaries (default pool) go back too
            if plan.release_context:
                self._release_context(plan, before)
        return report

    def _settle_running(self, mode: str, level: int) -> None:
        """What a sleep does with the running requests first (see `sleep`)."""
        if mode == "abort":
            for seq in list(self.scheduler.running):
                output = self.abort_request(seq.request_id)
                if output is not None:
                    self._pending.append(output)
        elif mode == "keep":
            if level != 0:
                self.scheduler.retract()  # their KV goes with the sleep: they recompute after the wake
        else:
            self.lifecycle.start_drain()
            try:
                self._drain_running("sleep(mode='wait')")
            finally:
                self.lifecycle.end_drain()

    def _check_settle(self, mode: str, what: str) -> None:
        """A sleep that waits for the running requests needs them to be able to run (a weight update in
        progress ends first)."""
        lc = self.lifecycle
        if mode == "wait" and self.scheduler.running and lc.updating is None and not lc.may_run():
            raise LifecycleError(f"{what}: {len(self.scheduler.running)} running requests cannot finish now: "
                                 f"{self.state().not_serving_reason()}; use mode 'abort' or 'keep'")

    def _drain_running(self, what: str) -> None:
        """Step until no request runs (their outputs come out of the next `step`); raises LifecycleError if they
        cannot run (nothing would end the loop)."""
        while self.scheduler.running:
            if not self.lifecycle.may_run():
                raise LifecycleError(f"{what}: {len(self.scheduler.running)} running requests cannot finish: "
                                     f"{self.state().not_serving_reason()}")
            self._pending = self.step()  # step hands back what was pending plus what it produced

    def _check_no_receive(self, what: str) -> None:
        receiving = self.weights.receiving()
        if receiving:
            raise LifecycleError(f"{what}: weights update group(s) {receiving} are receiving a trainer's broadcasts; "
                                 "call it once update_weights_from_distributed has answered")

    def _check_context_release(self, level: int) -> None:
        """Level 3/4's preconditions: one CUDA device per engine process, the driver's checkpoint API."""
        device = self.executor.driver.device
        if device.type != "cuda":
            raise CheckpointUnsupportedError(
                f"sleep level {level} releases the CUDA context; this engine runs on {device}, which has none "
                "(levels 0-2 work on every device)")
        if self.executor.world_size > 1:
            raise CheckpointUnsupportedError(
                f"sleep level {level} releases the CUDA context through the driver's checkpoint API, which does "
                "not support several processes sharing memory (tensor parallel): such an engine sleeps at levels 0-2")
        self.executor.driver.check_checkpoint()

    def _release_context(self, plan: SleepPlan, before: int | None) -> None:
        """Checkpoint the context after the tags slept. On failure the tags' sleep is undone where it can be
        (level 3 from awake: the engine serves again); a level-4 sleep stays at level 2 (weights discarded)."""
        driver, lc = self.executor.driver, self.lifecycle
        try:
            driver.checkpoint_context()
        except Exception as exc:
            if driver.is_context_checkpointed():  # stuck checkpointed: only a wake's restore may help
                lc.context_checkpointed(plan)
                state = f"the engine stays asleep at level {lc.level}: wake_up() retries the restore"
            elif before is None and lc.weights_whole:
                woken = [t for t in lc.tags if lc.is_asleep(t)]
                self.executor.wake(woken)
                self.scheduler.reset_blocks()  # the KV cache came back zeroed
                lc.woke(woken)
                state = "the engine is awake and serving as before"
            else:
                state = (f"the engine stays asleep at level {lc.level}" + (
                    " (weights discarded: wake_up() then reload_weights())" if not lc.weights_whole else ""))
            raise ContextCheckpointError(f"sleep level {plan.level}: releasing the CUDA context failed ({exc}); "
                                         f"{state}") from exc
        lc.context_checkpointed(plan)

    def _restore_context(self) -> None:
        """Restore the checkpointed context (before any tag is touched). On failure it stays checkpointed."""
        self.executor.driver.restore_context()
        self.lifecycle.context_restored()

    def wake_up(self, tags: list[str] | None = None) -> WakeResult:
        """Wake `tags` (all when None); any wake also restores every tag but weights and kv_cache. The engine serves
        again once every tag is awake and its weights are whole."""
        lc, start = self.lifecycle, time.perf_counter()
        targets = lc.plan_wake(tags)
        with self.weights.held(drop=False):
            if lc.context_released:
                self._restore_context()  # the context first, then the tags
            report = self.executor.wake(targets)
            if "kv_cache" in targets:
                self.scheduler.reset_blocks()  # the cache came back zeroed: no block holds anything
            lc.woke(targets)
        return WakeResult(report, tuple(targets), lc.serving, time.perf_counter() - start)

    # ---- the weights (every write: weights/receiver.py) --------------------------------------
    def reload_weights(self, path: str | None = None, version: str | None = None, flush_cache: bool = True) -> None:
        """Load the weights again from `path` (default: the model's checkpoint) into the same tensors; `version`
        labels them once loaded; `flush_cache` False (SGLang's) keeps the prefix cache's K/V of the old weights."""
        self.weights.check_awake("reload_weights")
        if version is not None:
            check_version(version)
        if flush_cache:
            self.reset_prefix_cache()  # K/V computed with the old weights must not serve new requests
        self.weights.reload(path or self.config.model, version, flush_cache)

    def update_weights(self, named_tensors, staged: bool = False) -> int:
        """Copy new weights, named as in the Hugging Face checkpoint, into the model (an RL trainer's push); any
        subset (after a level-2 sleep the engine serves again once every tensor came). Returns the count."""
        return self.weights.update_weights(named_tensors, staged=staged)

    def update_weights_from_tensor(self, serialized_named_tensors=None, load_format: str | None = None,
                                   flush_cache: bool = True, named_tensors=None,
                                   push: PushPosition | None = None, weight_version: str | None = None) -> int:
        """`weight_version`: the label of the weights once the update commits (only then)."""
        return self.weights.update_from_tensor(serialized_named_tensors, load_format, flush_cache, named_tensors,
                                               push, weight_version)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str | None = None,
                                  timeout: float = DEFAULT_GROUP_TIMEOUT_S) -> None:
        self.weights.init_group(master_address, master_port, rank_offset, world_size, group_name, backend, timeout)

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        timeout: float | None = None, weight_version: str | None = None) -> int:
        """Receive the trainer's broadcasts (every rank, on threads of their own), then copy them all. Blocks its
        caller; the server receives off its engine thread (start_receive / receive_done / apply_received)."""
        timeout = DEFAULT_GROUP_TIMEOUT_S if timeout is None else timeout
        self.weights.start_receive(names, dtypes, shapes, group_name, timeout)
        self.weights.wait_receive(group_name, timeout + 5.0, timeout)  # the receive ends by its own deadline
        return self.weights.apply_received(names, group_name, flush_cache, version=weight_version)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self.weights.destroy_group(group_name)

    def _reserve_host_copies(self):
        """Start reserving (pinning) the host copies a level-1 sleep needs, in the background, so the first sleep runs
        as fast as the later ones (`EngineConfig.reserve_host_copies`)."""
        if not self.config.reserve_host_copies or self.memory is None:
            return None
        tags = [t for t in ("weights", "runtime", "cuda_graph") if t in self.memory.tags()]
        usage = self.memory.usage()
        need = sum(usage[t].reserved_bytes for t in tags)
        logger.info("reserving %.2f GiB of host memory for the host copies of %s in the background, so the first "
                    "sleep runs at link speed (reserve_host_copies=False turns it off)", need / 2**30, ", ".join(tags))
        return self.memory.reserve_host_in_background(tags, on_done=_log_reservation)


def _log_reservation(reservation) -> None:
    if reservation.error is not None:
        logger.warning("reserving host copies stopped after %.2f GiB: %s (the first sleep makes the rest)",
                       reservation.reserved_bytes / 2**30, reservation.error)
    else:
        logger.info("host copies reserved: %.2f GiB of host memory in %.2f s", reservation.reserved_bytes / 2**30,
                    reservation.seconds)
