"""The engine loop: requests in, one scheduled batch per `step`, finished requests out."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from dataclasses import asdict

import torch

from torpor.engine.config import EngineConfig
from torpor.engine.model_runner import ModelRunner
from torpor.engine.outputs import RequestOutput
from torpor.engine.sampling_params import SamplingParams
from torpor.engine.scheduler import Scheduler
from torpor.engine.sequence import Sequence
from torpor.engine.sleep_mode import LEVELS, SleepMode, WakeResult
from torpor.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from torpor.memory import CheckpointError, CheckpointUnsupportedError, Report

logger = logging.getLogger("torpor.engine")


class LLMEngine:
    """Tokenizer, scheduler and model runner; detokenizes outputs and applies stop strings."""

    def __init__(self, config: EngineConfig, memory=None, worker_memory_options: dict[int, dict] | None = None) -> None:
        """`worker_memory_options` (tensor parallel only): rank -> MemoryManager kwargs of that worker."""
        self.tokenizer = Tokenizer.from_pretrained(config.model)
        if config.tensor_parallel_size > 1:
            from torpor.engine.parallel_runner import ParallelModelRunner

            self.model_runner = ParallelModelRunner(config, memory, worker_memory_options)
            memory = self.model_runner.memory  # sleep and wake reach every rank
        else:
            self.model_runner = ModelRunner(config, memory)
        self.memory = memory
        self.sleep_mode = SleepMode(memory) if memory is not None else None
        self._pending: list[RequestOutput] = []  # finished outside `step` (drained or aborted by a sleep)
        self.config = self.model_runner.config  # with the profiled number of KV blocks
        model_config = self.model_runner.model_config
        self.vocab_size = model_config.vocab_size
        self.scheduler = Scheduler(self.config, model_config.eos_token_ids)
        self._texts: dict[str, _Text] = {}
        self._request_ids = itertools.count()
        self.host_reservation = self._reserve_host_copies()

    # ---- requests ----------------------------------------------------------------------
    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None) -> Sequence:
        """A validated request (not queued yet): ValueError names what is wrong with it."""
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is an empty string")
            token_ids, text = self.tokenizer.encode(prompt), prompt
        else:
            token_ids, text = list(prompt), None
            bad = [t for t in token_ids
                   if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be ints in [0, {self.vocab_size}) (the vocabulary), "
                                 f"got {bad[:5]}")
        if not token_ids:
            raise ValueError("the prompt has no tokens")
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; it must be shorter than max_model_len "
                             f"({self.config.max_model_len}) to leave room for an output token")
        request_id = str(next(self._request_ids)) if request_id is None else request_id
        return Sequence(request_id, token_ids, params, text)

    def add_sequence(self, seq: Sequence) -> str:
        self.scheduler.add(seq)
        self._texts[seq.request_id] = _Text(self.tokenizer, seq.sampling_params.stop)
        return seq.request_id

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request (text or token ids); returns its id."""
        return self.add_sequence(self.make_sequence(prompt, params, request_id))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a waiting or running request; returns its output (finish_reason 'abort')."""
        seq = self.scheduler.abort(request_id)
        text = self._texts.pop(request_id, None)
        if seq is None or text is None:
            return None
        return RequestOutput.from_sequence(seq, text.final(seq.output_token_ids))

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one device)."""
        close = getattr(self.model_runner, "close", None)
        if close is not None:
            close()

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule a batch, run it, record the tokens; returns the requests finished by this step
        (and any a sleep finished meanwhile). Runs nothing while the engine sleeps."""
        finished, self._pending = self._pending, []
        if self.context_released:
            return finished  # no CUDA call while the context is checkpointed (the scheduler is paused anyway)
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return finished
        output = self.model_runner.run(seqs, is_prefill)
        self.scheduler.postprocess(seqs, output.token_ids, output.logprobs)
        return finished + self._postprocess_text(seqs)

    # ---- sleep mode (see sleep_mode.py) ------------------------------------------------
    def sleep(self, level: int = 1, running: str = "wait") -> Report | None:
        """Level 0 pauses scheduling; 1 and 2 also release memory; 3 and 4 are 1 and 2 plus the CUDA context
        (see sleep_mode.py). Running requests are finished first (`running="wait"`, new ones are not
        started) or aborted (`"abort"`); their outputs come out of the next `step`. A sleep that deepens
        nothing is a no-op (None). Level 3/4's preconditions are checked before anything is touched."""
        mode = self._sleep_mode()
        if running not in ("wait", "abort"):
            raise ValueError(f"running must be 'wait' or 'abort', got {running!r}")
        plan = mode.plan(level)
        if plan is None:
            return None
        release = mode.releases_context(level)
        if release and not mode.context_released:
            self._check_context_release(level)
        if mode.level is None or mode.level == 0:
            self._settle_running(running)
        if mode.context_released and plan:
            self._restore_context()  # dropping host copies needs the context
        before = mode.level
        try:
            report = self.memory.sleep(plan) if plan else None
        except BaseException:
            if mode.level is None:
                self.scheduler.resume()  # the failed sleep left every tag awake: serve again
            raise
        self.scheduler.pause()
        mode.after_sleep(level)
        if self.model_runner.device.type == "cuda" and plan:
            torch.cuda.empty_cache()  # the steps' cached temporaries (default pool) go back too
        if release:
            self._release_context(level, before)
        return report

    def _check_context_release(self, level: int) -> None:
        """Level 3/4's preconditions: one CUDA device per engine process, the driver's checkpoint API."""
        if self.model_runner.device.type != "cuda":
            raise CheckpointUnsupportedError(
                f"sleep level {level} releases the CUDA context; this engine runs on {self.model_runner.device}, "
                "which has none (levels 0-2 work on every device)")
        if self.config.tensor_parallel_size > 1:
            raise CheckpointUnsupportedError(
                f"sleep level {level} releases the CUDA context through the driver's checkpoint API, which does "
                "not support NCCL: a tensor-parallel engine sleeps at levels 0-2")
        self.memory.check_checkpoint()

    def _release_context(self, level: int, before: int | None) -> None:
        """Checkpoint the context after the tags slept. On failure the tags' sleep is undone where it can be
        (level 3 from awake: the engine serves again); a level-4 sleep stays at level 2 (weights discarded)."""
        mode = self.sleep_mode
        try:
            self.memory.checkpoint_context()
        except Exception as exc:
            if self.memory.is_context_checkpointed():  # stuck checkpointed: only a wake's restore may help
                mode.after_sleep(level, context_released=True)
                state = f"the engine stays asleep at level {mode.level}: wake_up() retries the restore"
            elif before is None and not mode.weights_discarded:
                self.memory.wake()
                self.scheduler.reset_blocks()  # the KV cache came back zeroed
                mode.level = None
                self.scheduler.resume()
                state = "the engine is awake and serving as before"
            else:
                state = (f"the engine stays asleep at level {mode.level}"
                         + (" (weights discarded: wake_up() then reload_weights())" if mode.weights_discarded else ""))
            raise CheckpointError(f"sleep level {level}: releasing the CUDA context failed ({exc}); {state}") from exc
        mode.after_sleep(level, context_released=True)

    def _restore_context(self) -> None:
        """Restore the checkpointed context (before any tag is touched). On failure it stays checkpointed."""
        self.memory.restore_context()
        self.sleep_mode.context_released = False

    @property
    def context_released(self) -> bool:
        """Whether the CUDA context is checkpointed (level 3/4 until a wake): nothing may make a CUDA call."""
        return self.sleep_mode is not None and self.sleep_mode.context_released

    def _settle_running(self, running: str) -> None:
        if running == "abort":
            for seq in list(self.scheduler.running):
                output = self.abort_request(seq.request_id)
                if output is not None:
                    self._pending.append(output)
            return
        self.scheduler.resume()
        self.scheduler.drain()
        while self.scheduler.running:
            self._pending = self.step()  # step hands back what was pending plus what it finished

    def wake_up(self, tags: list[str] | None = None) -> WakeResult:
        """Wake `tags` (all when None); any wake also restores every tag but weights and kv_cache.
        The engine serves again once every tag is awake and its weights are valid."""
        mode = self._sleep_mode()
        targets = mode.wake_targets(tags)
        if mode.context_released:
            self._restore_context()  # the context first, then the tags
        report = self.memory.wake(targets)
        if "weights" in targets:
            self.memory.mark_clean("weights")  # unwritten since the wake: the next level-1 sleep keeps the copy
        if "kv_cache" in targets:
            self.scheduler.reset_blocks()  # the cache came back zeroed: no block holds anything
        return WakeResult(report, tuple(targets), self._resume_if_ready(ends_pause=True))

    def is_sleeping(self) -> bool:
        return self.sleep_mode is not None and self.sleep_mode.level is not None

    def reload_weights(self, path: str | None = None) -> None:
        """Load the weights again from `path` (default: the model's checkpoint) into the same tensors."""
        self._weights_awake("reload_weights")
        self.mark_weights_dirty()
        self.model_runner.reload_weights(path or self.config.model)
        self._weights_restored()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy new weights, named as in the Hugging Face checkpoint, into the model (an RL trainer's
        push). After a level-2 sleep every weight must be given; otherwise any subset. Returns the count."""
        self._weights_awake("update_weights")
        self.mark_weights_dirty()
        strict = self.sleep_mode is not None and self.sleep_mode.weights_discarded
        count = self.model_runner.update_weights(named_tensors, strict=strict)
        self._weights_restored()
        return count

    def memory_usage(self) -> dict:
        """Per-tag bytes and states, the sleep level, and the device memory in use."""
        mode = self._sleep_mode()
        tags = {tag: asdict(usage) for tag, usage in self.memory.usage().items()}
        reservation = self.host_reservation
        return {"level": mode.level, "device_used_bytes": self.memory.device_used_bytes(),
                "weights_discarded": mode.weights_discarded, "context_released": mode.context_released,
                "host_backup_bytes": sum(t["host_backup_bytes"] for t in tags.values()),
                "host_reservation": None if reservation is None else
                {"done": reservation.done, "reserved_bytes": reservation.reserved_bytes,
                 "error": None if reservation.error is None else str(reservation.error)},
                "tags": tags}

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
            self._resume_if_ready(ends_pause=False)

    def _resume_if_ready(self, ends_pause: bool) -> bool:
        """Serve again once every tag is awake and the weights are valid; only a wake ends a level-0
        pause. Returns whether the engine serves."""
        mode = self.sleep_mode
        if mode.level is not None:
            if (mode.level == 0 and not ends_pause) or self.memory.is_sleeping() or mode.context_released:
                return False
            mode.level = None
        if mode.weights_discarded:
            return False
        self.scheduler.resume()
        return True

    def _postprocess_text(self, seqs: list[Sequence]) -> list[RequestOutput]:
        finished = []
        for seq in seqs:
            text = self._texts.get(seq.request_id)
            if text is None:  # aborted while its step ran
                continue
            stop = text.update(seq.output_token_ids)
            if stop is not None:
                if seq.is_finished:  # ended by this token anyway (eos, length): the stop string names it
                    seq.finish_reason, seq.stop_reason = "stop", stop
                else:
                    self.scheduler.finish(seq, "stop", stop)
            if seq.is_finished:
                del self._texts[seq.request_id]
                finished.append(RequestOutput.from_sequence(seq, text.final(seq.output_token_ids)))
        return finished


def _log_reservation(reservation) -> None:
    if reservation.error is not None:
        logger.warning("reserving host copies stopped after %.2f GiB: %s (the first sleep makes the rest)",
                       reservation.reserved_bytes / 2**30, reservation.error)
    else:
        logger.info("host copies reserved: %.2f GiB of host memory in %.2f s", reservation.reserved_bytes / 2**30,
                    reservation.seconds)


class _Text:
    """The output text of one request, grown token by token, cut before the first stop string."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.text = ""
        self.stopped = False

    def update(self, output_token_ids: list[int]) -> str | None:
        """Detokenize the tokens not seen yet; returns the stop string found (the text then ends before
        it), else None. Without stop strings nothing happens here: `final` decodes the whole output."""
        if not self.stop:
            return None
        for token_id in output_token_ids[len(self.detokenizer.token_ids):]:
            delta = self.detokenizer.step(token_id)
            if not delta:
                continue
            # A stop string may straddle the old text and the delta: search from where it could start.
            search_from = max(0, len(self.text) - max(len(s) for s in self.stop) + 1)
            self.text += delta
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) != -1]
            if hits:
                index, stop = min(hits)
                self.text, self.stopped = self.text[:index], True
                return stop
        return None

    def final(self, output_token_ids: list[int]) -> str:
        """The finished text; without a stop string, a full decode (it includes any bytes the incremental
        detokenizer still held back for an unfinished character)."""
        return self.text if self.stopped else self.tokenizer.decode(output_token_ids)
