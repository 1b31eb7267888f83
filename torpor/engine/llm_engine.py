"""The engine loop: requests in, one scheduled batch per `step`, outputs (with their text) out.

`LLMEngine` is also the one place that holds the engine's state: `state()` (serving, sleep level,
weights validity, per-tag state) and `memory_usage()` (every tensor-parallel rank). Both front ends,
`LLM` and the server's `AsyncEngine`, read only these. Output text is built here too, once per request
(`tokenizer.OutputText`): streamed deltas already respect stop strings.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

import torch

from torpor.engine.config import EngineConfig
from torpor.engine.model_runner import ModelRunner, debug_logging, timed_phase
from torpor.engine.outputs import RequestOutput
from torpor.engine.phase_times import phase
from torpor.engine.sampling_params import OutOfVocabulary, SamplingParams
from torpor.engine.scheduler import Scheduler
from torpor.engine.sequence import FINISHED, Sequence
from torpor.engine.sleep_mode import LEVELS, SleepMode, WakeResult
from torpor.engine.tokenizer import OutputText, Tokenizer
from torpor.lazy import collector_paused
from torpor.memory import CheckpointError, CheckpointUnsupportedError, Report

logger = logging.getLogger("torpor.engine")

SLEEP_MODES = ("wait", "abort")


class RequestError(ValueError):
    """A request the engine refuses. `field`: the part at fault ("prompt", "max_tokens", "sampling_params",
    "request_id"); `code`: a machine-readable reason where one helps a client (context_length_exceeded)."""

    def __init__(self, message: str, field: str, code: str | None = None) -> None:
        super().__init__(message)
        self.field, self.code = field, code


@dataclass(frozen=True)
class EngineState:
    """What the engine does now: the one state both front ends show."""

    serving: bool                 # requests run: awake (no sleep level) and the weights valid
    sleep_level: int | None       # None = awake; 0 = paused; 1, 2 = memory released; 3, 4 = and the context
    weights_valid: bool           # False from a level-2 sleep until reload_weights / update_weights
    tags: dict[str, str]          # memory tag -> "awake" | "asleep" (empty without sleep mode)
    num_running: int = 0          # requests in the running batch
    num_waiting: int = 0          # requests queued (new or preempted)

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level is not None

    def not_serving_reason(self) -> str | None:
        """What stops requests from running and what to call about it; None while serving."""
        if self.serving:
            return None
        asleep = [tag for tag, state in self.tags.items() if state == "asleep"]
        reload = "reload_weights() or update_weights() (HTTP: /reload_weights)"
        if self.sleep_level is None:
            return (f"the weights are not valid (discarded by sleep(level=2), or a reload or update failed after "
                    f"writing part of them) and every tag is awake: call {reload}")
        if self.sleep_level == 0:
            return "the engine is paused (sleep level 0): call wake_up() (HTTP: /wake_up)"
        wake = (f"the engine sleeps (level {self.sleep_level}; asleep: {', '.join(asleep)}): call wake_up() "
                f"(HTTP: /wake_up)")
        return wake if self.weights_valid else f"{wake}, then {reload}"


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


WEIGHTS_INVALID = ("the weights are invalid: a reload or update failed after writing part of them; call "
                   "reload_weights() or a complete update_weights() before generating")


class LLMEngine:
    """Tokenizer, scheduler and model runner; detokenizes outputs, applies stop strings, sleeps and wakes."""

    @collector_paused()  # start-up: no full garbage collections over torch's objects (torpor/lazy.py)
    def __init__(self, config: EngineConfig, memory=None, worker_memory_options: dict[int, dict] | None = None) -> None:
        """`worker_memory_options` (tensor parallel only): rank -> MemoryManager kwargs of that worker."""
        debug_logging()
        with timed_phase("tokenizer"):
            self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or config.model)
        if config.tensor_parallel_size > 1:
            from torpor.engine.parallel_runner import ParallelModelRunner

            self.model_runner = ParallelModelRunner(config, memory, worker_memory_options)
            memory = self.model_runner.memory  # sleep and wake reach every rank
        else:
            self.model_runner = ModelRunner(config, memory)
        self.memory = memory
        self.sleep_mode = SleepMode(memory) if memory is not None else None
        self._pending: list[RequestOutput] = []  # produced outside `step` (drained or aborted by a sleep)
        self.config = self.model_runner.config  # with the profiled number of KV blocks
        model_config = self.model_runner.model_config
        self.vocab_size = model_config.vocab_size
        self.scheduler = Scheduler(self.config, model_config.eos_token_ids)
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
        if params.return_routed_experts and not self.model_runner.model_config.is_moe:
            raise RequestError(f"return_routed_experts needs a mixture-of-experts model; "
                               f"{self.model_runner.model_config.architecture} has no routed experts",
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

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (blocks in use stay with their sequences; they register nothing
        more). Done by the engine itself whenever the weights change or the KV cache is discarded."""
        self.scheduler.block_manager.reset_prefix_cache()
        return True

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
        """Whether `step` would run something: the engine serves and a request waits or runs."""
        return self.serving and not self.scheduler.is_finished()

    def close(self) -> None:
        """Free the CUDA graphs and the GEMM workspace and stop the tensor-parallel workers; the engine
        cannot run afterwards."""
        from torpor.engine.weight_transfer import destroy_all_groups

        destroy_all_groups(getattr(self.model_runner, "local", self.model_runner))  # workers' go with them
        self.model_runner.close()

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule a batch, run it, record the tokens; returns the outputs of this step (finished requests,
        and streamed ones that gained tokens) and any a sleep produced meanwhile. Runs nothing while the
        engine does not serve."""
        if not self.model_runner.weights_valid and not self.scheduler.paused and not self.scheduler.is_finished():
            raise RuntimeError(WEIGHTS_INVALID)  # (with sleep mode the scheduler is paused instead)
        outputs, self._pending = self._pending, []
        if self.context_released:
            return outputs  # no CUDA call while the context is checkpointed (the scheduler is paused anyway)
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return outputs
        output = self.model_runner.run(seqs, is_prefill)
        self.scheduler.postprocess(seqs, output.token_ids, output.logprobs, output.routed_experts)
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
        """Requests run: no sleep level and the weights valid."""
        mode = self.sleep_mode
        awake = mode is None or (mode.level is None and not mode.weights_discarded)
        return awake and self.model_runner.weights_valid

    def is_sleeping(self) -> bool:
        return self.sleep_mode is not None and self.sleep_mode.level is not None

    def state(self) -> EngineState:
        """Serving, sleep level, weights validity and per-tag state, read together."""
        mode = self.sleep_mode
        tags = {} if mode is None else {t: "asleep" if self.memory.is_sleeping(t) else "awake" for t in mode.tags}
        weights_valid = (mode is None or not mode.weights_discarded) and self.model_runner.weights_valid
        return EngineState(serving=self.serving, sleep_level=None if mode is None else mode.level,
                           weights_valid=weights_valid, tags=tags,
                           num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting))

    def memory_usage(self) -> dict:
        """Per-tag bytes and states, the sleep level, the device memory in use (rank 0's device); under
        tensor parallelism also "ranks": each rank's device, its memory in use and its tags."""
        mode = self._sleep_mode()
        tags = {tag: asdict(usage) for tag, usage in self.memory.usage().items()}
        reservation = self.host_reservation
        usage = {"level": mode.level, "device_used_bytes": self.memory.device_used_bytes(),
                 "weights_discarded": mode.weights_discarded, "context_released": mode.context_released,
                 "host_backup_bytes": sum(t["host_backup_bytes"] for t in tags.values()),
                 "host_reservation": None if reservation is None else
                 {"done": reservation.done, "reserved_bytes": reservation.reserved_bytes,
                  "error": None if reservation.error is None else str(reservation.error)},
                 "tags": tags}
        rank_usage = getattr(self.model_runner, "rank_usage", None)
        if rank_usage is not None:
            usage["ranks"] = rank_usage()
        return usage

    def _sync_scheduler(self) -> None:
        """The scheduler runs exactly when the engine serves (the one rule; called after every change)."""
        self.scheduler.resume()  # also ends a drain
        if not self.serving:
            self.scheduler.pause()

    # ---- sleep mode (see sleep_mode.py) ------------------------------------------------
    def sleep(self, level: int = 1, mode: str = "wait") -> Report | None:
        """Level 0 pauses scheduling; 1 and 2 also release memory; 3 and 4 are 1 and 2 plus the CUDA context
        (see sleep_mode.py). Running requests are finished first (`mode="wait"`, new ones are not started)
        or aborted (`"abort"`); their outputs come out of the next `step`. A sleep that deepens nothing is a
        no-op (None). A sleep that fails leaves the engine as it was before (same level, serving if it
        served); level 3/4's preconditions are checked before anything is touched."""
        sleep_mode = self._sleep_mode()
        if mode not in SLEEP_MODES:
            raise ValueError(f"mode must be 'wait' (running requests finish first) or 'abort', got {mode!r}")
        plan = sleep_mode.plan(level)
        if plan is None:
            return None
        release = sleep_mode.releases_context(level)
        if release and not sleep_mode.context_released:
            self._check_context_release(level)
        if plan and not sleep_mode.context_released:
            self.memory.check_sleep(plan)  # a sleep bound to fail must not settle (abort) requests first
        before = sleep_mode.level
        with self._transfers_held(drop="weights" in plan or release):
            try:
                if sleep_mode.level in (None, 0):  # requests may be running
                    self._settle_running(mode)
                if sleep_mode.context_released and plan:
                    self._restore_context()  # dropping host copies needs the context
                report = self.memory.sleep(plan) if plan else None
            except BaseException:
                # The failed sleep may have discarded the KV cache before it rolled back (zeroed blocks): the
                # prefix cache must not serve them. Nothing runs now (running requests were settled above).
                self.reset_prefix_cache()
                self._sync_scheduler()  # the level did not change: the scheduler goes back to what it did
                raise
            sleep_mode.after_sleep(level)
            self._sync_scheduler()
            if self.model_runner.device.type == "cuda" and plan:
                torch.cuda.empty_cache()  # the steps' cached temporaries (default pool) go back too
            if release:
                self._release_context(level, before)
        return report

    @contextlib.contextmanager
    def _transfers_held(self, drop: bool) -> Iterator[None]:
        """While a sleep or wake changes the memory (and, at levels 3/4, the CUDA context), no trainer payload is
        opened off the engine thread (`WeightReceiver.held`); with `drop` (the weights or the context go),
        payloads opened for a copy still to come are released first: they answer 409, nothing is written."""
        receiver = getattr(self, "_weight_receiver", None)
        if receiver is None:
            yield
            return
        with receiver.held(drop):
            yield

    def _check_context_release(self, level: int) -> None:
        """Level 3/4's preconditions: one CUDA device per engine process, the driver's checkpoint API."""
        if self.model_runner.device.type != "cuda":
            raise CheckpointUnsupportedError(
                f"sleep level {level} releases the CUDA context; this engine runs on {self.model_runner.device}, "
                "which has none (levels 0-2 work on every device)")
        if self.config.tensor_parallel_size > 1:
            raise CheckpointUnsupportedError(
                f"sleep level {level} releases the CUDA context through the driver's checkpoint API, which does "
                "not support several processes sharing memory (tensor parallel): such an engine sleeps at levels 0-2")
        self.memory.check_checkpoint()

    def _release_context(self, level: int, before: int | None) -> None:
        """Checkpoint the context after the tags slept. On failure the tags' sleep is undone where it can be
        (level 3 from awake: the engine serves again); a level-4 sleep stays at level 2 (weights discarded)."""
        sleep_mode = self.sleep_mode
        try:
            self.memory.checkpoint_context()
        except Exception as exc:
            if self.memory.is_context_checkpointed():  # stuck checkpointed: only a wake's restore may help
                sleep_mode.after_sleep(level, context_released=True)
                state = f"the engine stays asleep at level {sleep_mode.level}: wake_up() retries the restore"
            elif before is None and not sleep_mode.weights_discarded:
                self.memory.wake()
                self.scheduler.reset_blocks()  # the KV cache came back zeroed
                sleep_mode.level = None
                state = "the engine is awake and serving as before"
            else:
                state = (f"the engine stays asleep at level {sleep_mode.level}" + (
                    " (weights discarded: wake_up() then reload_weights())" if sleep_mode.weights_discarded else ""))
            self._sync_scheduler()
            raise CheckpointError(f"sleep level {level}: releasing the CUDA context failed ({exc}); {state}") from exc
        sleep_mode.after_sleep(level, context_released=True)
        self._sync_scheduler()

    def _restore_context(self) -> None:
        """Restore the checkpointed context (before any tag is touched). On failure it stays checkpointed."""
        self.memory.restore_context()
        self.sleep_mode.context_released = False

    @property
    def context_released(self) -> bool:
        """Whether the CUDA context is checkpointed (level 3/4 until a wake): nothing may make a CUDA call."""
        return self.sleep_mode is not None and self.sleep_mode.context_released

    def _settle_running(self, mode: str) -> None:
        if mode == "abort":
            for seq in list(self.scheduler.running):
                output = self.abort_request(seq.request_id)
                if output is not None:
                    self._pending.append(output)
            return
        self.scheduler.resume()
        self.scheduler.drain()
        while self.scheduler.running:
            self._pending = self.step()  # step hands back what was pending plus what it produced

    def wake_up(self, tags: list[str] | None = None) -> WakeResult:
        """Wake `tags` (all when None); any wake also restores every tag but weights and kv_cache.
        The engine serves again once every tag is awake and its weights are valid."""
        sleep_mode = self._sleep_mode()
        targets = sleep_mode.wake_targets(tags)
        with self._transfers_held(drop=False):
            try:
                if sleep_mode.context_released:
                    self._restore_context()  # the context first, then the tags
                report = self.memory.wake(targets)
                if "weights" in targets:
                    self.memory.mark_clean("weights")  # unwritten since the wake: the next level-1 sleep keeps it
                if "kv_cache" in targets:
                    self.scheduler.reset_blocks()  # the cache came back zeroed: no block holds anything
                if sleep_mode.level is not None and not self.memory.is_sleeping() and not sleep_mode.context_released:
                    sleep_mode.level = None  # every tag awake: a wake ends any sleep, level 0 included
            finally:
                self._sync_scheduler()
        return WakeResult(report, tuple(targets), self.serving)

    def reload_weights(self, path: str | None = None) -> None:
        """Load the weights again from `path` (default: the model's checkpoint) into the same tensors."""
        self._weights_awake("reload_weights")
        self.mark_weights_dirty()
        self.reset_prefix_cache()  # K/V computed with the old weights must not serve new requests
        try:
            self.model_runner.reload_weights(path or self.config.model)
        finally:
            self._stop_if_weights_invalid()
        self._weights_restored()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], staged: bool = False) -> int:
        """Copy new weights, named as in the Hugging Face checkpoint, into the model (an RL trainer's
        push). After a level-2 sleep every weight must be given; otherwise any subset. Returns the count.
        `staged`: see `loader.check_update`."""
        with phase("prepare"):
            self._weights_awake("update_weights")
            self.mark_weights_dirty()
            discarded = self.sleep_mode is not None and self.sleep_mode.weights_discarded
            strict = discarded or not self.model_runner.weights_valid  # after a mix, only the whole set will do
            self.reset_prefix_cache()  # K/V computed with the old weights must not serve new requests
        try:
            # The RoPE table lives with the weights: only a level-2 discard (which sets weights_discarded until
            # a complete update or reload) can have wiped it, so an update of intact weights leaves it be.
            count = self.model_runner.update_weights(named_tensors, strict=strict, reset_buffers=discarded,
                                                     staged=staged)
        finally:
            with phase("state"):
                self._stop_if_weights_invalid()
        with phase("state"):
            self._weights_restored()
        return count

    def _sleep_mode(self) -> SleepMode:
        if self.sleep_mode is None:
            raise RuntimeError("sleep mode is off: build the engine with a MemoryManager (enable_sleep_mode)")
        return self.sleep_mode

    def _weights_awake(self, what: str) -> None:
        if self.memory is not None and "weights" in self.memory.tags() and self.memory.is_sleeping("weights"):
            raise RuntimeError(f"{what}: the weights are asleep; call wake_up(['weights']) first")

    def _weights_restored(self) -> None:
        if self.sleep_mode is not None:
            self.sleep_mode.weights_discarded = False
            self._sync_scheduler()

    def _stop_if_weights_invalid(self) -> None:
        """A load or update that failed after writing part of the weights leaves a mix: never serve it.
        With sleep mode the weights count as discarded (serving resumes after a complete reload or
        update); without, `step` raises."""
        if self.model_runner.weights_valid:
            return
        if self.sleep_mode is not None:
            self.sleep_mode.weights_mixed()
            self._sync_scheduler()

    def release_tags(self, tags: Iterable[str], mode: str = "wait") -> Report | None:
        """Release only `tags`, each with its level-1 action (SGLang's `release_memory_occupation`):
        the engine pauses as at level 1 and a `wake_up` naming them (or all) restores them. Tags that
        do not exist on this device or already sleep are skipped; None when nothing is released."""
        from torpor.engine.sleep_mode import LEVELS, SLEEP_TAGS

        sleep_mode = self._sleep_mode()
        tags = list(tags)
        unknown = sorted(set(tags) - set(SLEEP_TAGS))
        if unknown:
            raise ValueError(f"unknown tag(s) {unknown}; the engine's tags are {list(SLEEP_TAGS)}")
        if mode not in SLEEP_MODES:
            raise ValueError(f"mode must be 'wait' (running requests finish first) or 'abort', got {mode!r}")
        plan = {t: LEVELS[1][t] for t in sleep_mode.tags if t in tags and not self.memory.is_sleeping(t)}
        if not plan:
            return None
        self.memory.check_sleep(plan)  # a release bound to fail must not settle (abort) requests first
        with self._transfers_held(drop="weights" in plan):
            try:
                if sleep_mode.level in (None, 0):  # requests may be running
                    self._settle_running(mode)
                report = self.memory.sleep(plan)
            except BaseException:
                self._sync_scheduler()  # nothing was released: back to what the engine did
                raise
            if sleep_mode.level in (None, 0):
                sleep_mode.after_sleep(1)
            self._sync_scheduler()
        return report

    def mark_weights_dirty(self) -> None:
        """Every path that writes the weights calls this first (reload, update, a trainer's push): the next
        level-1 sleep then copies them again instead of keeping the host copy made before."""
        if self.memory is not None and "weights" in self.memory.tags():
            self.memory.mark_dirty("weights")

    def _reserve_host_copies(self):
        """Start reserving (pinning) the host copies a level-1 sleep needs, in the background, so the first
        sleep runs as fast as the later ones (`EngineConfig.reserve_host_copies`)."""
        if not self.config.reserve_host_copies or self.memory is None:
            return None
        present = self.memory.tags()
        tags = [t for t, action in LEVELS[1].items() if action == "offload" and t in present]
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
