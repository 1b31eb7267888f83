"""The engine loop: requests in, one scheduled batch per `step`, finished requests out."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import asdict

import torch

from torpor.engine.config import EngineConfig
from torpor.engine.model_runner import ModelRunner
from torpor.engine.outputs import RequestOutput
from torpor.engine.sampling_params import SamplingParams
from torpor.engine.scheduler import Scheduler
from torpor.engine.sequence import Sequence
from torpor.engine.sleep_mode import SleepMode, WakeResult
from torpor.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from torpor.memory import Report


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
        self._samples: dict[str, list[Sequence]] = {}    # unfinished requests: their samples, index order
        self._texts: dict[tuple[str, int], _Text] = {}  # by seq_id
        self._request_ids = itertools.count()

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
        self.scheduler.check_n(params.n, len(token_ids))
        request_id = str(next(self._request_ids)) if request_id is None else request_id
        return Sequence(request_id, token_ids, params, text)

    def add_sequence(self, seq: Sequence) -> str:
        """Queue a sequence made by `make_sequence` (with n > 1 its other samples are made here)."""
        samples = self.scheduler.add(seq)
        self._samples[seq.request_id] = samples
        for sample in samples:
            self._texts[sample.seq_id] = _Text(self.tokenizer, sample.sampling_params.stop)
        return seq.request_id

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request (text or token ids); returns its id."""
        return self.add_sequence(self.make_sequence(prompt, params, request_id))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a waiting or running request; returns its output (finish_reason 'abort')."""
        samples = self._samples.get(request_id)
        if self.scheduler.abort(request_id) is None or samples is None:
            return None
        return self._request_output(samples)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (blocks in use stay with their sequences; they register nothing
        more). Done by the engine itself whenever the weights change or the KV cache is discarded."""
        self.scheduler.block_manager.reset_prefix_cache()
        return True

    def prefix_cache_stats(self) -> dict[str, int]:
        """Prompt tokens looked up in the prefix cache and found there (counters since start-up)."""
        bm = self.scheduler.block_manager
        return {"queries": bm.num_queried_tokens, "hits": bm.num_hit_tokens}

    def _request_output(self, samples: list[Sequence]) -> RequestOutput:
        """The output of a request whose samples all finished (its bookkeeping is dropped)."""
        self._samples.pop(samples[0].request_id, None)
        texts = [self._texts.pop(seq.seq_id) for seq in samples]
        return RequestOutput.from_sequences(samples, [t.final(s.output_token_ids) for s, t in zip(samples, texts,
                                                                                                    strict=True)])

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
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return finished
        output = self.model_runner.run(seqs, is_prefill)
        self.scheduler.postprocess(seqs, output.token_ids, output.logprobs)
        return finished + self._postprocess_text(seqs)

    # ---- sleep mode (see sleep_mode.py) ------------------------------------------------
    def sleep(self, level: int = 1, running: str = "wait") -> Report | None:
        """Level 0 pauses scheduling; 1 and 2 also release memory (see sleep_mode.py). Running requests
        are finished first (`running="wait"`, new ones are not started) or aborted (`"abort"`); their
        outputs come out of the next `step`. Same or shallower level while asleep: no-op (None)."""
        mode = self._sleep_mode()
        if running not in ("wait", "abort"):
            raise ValueError(f"running must be 'wait' or 'abort', got {running!r}")
        plan = mode.plan(level)
        if plan is None:
            return None
        if mode.level is None or mode.level == 0:
            self._settle_running(running)
        try:
            report = self.memory.sleep(plan) if plan else None
        except BaseException:
            # The failed sleep may have discarded the KV cache before it rolled back (zeroed blocks): the
            # prefix cache must not serve them. Nothing runs now (running requests were settled above).
            self.reset_prefix_cache()
            if mode.level is None:
                self.scheduler.resume()  # the failed sleep left every tag awake: serve again
            raise
        self.scheduler.pause()
        mode.after_sleep(level)
        if self.model_runner.device.type == "cuda" and plan:
            torch.cuda.empty_cache()  # the steps' cached temporaries (default pool) go back too
        return report

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
        report = self.memory.wake(targets)
        if "kv_cache" in targets:
            self.scheduler.reset_blocks()  # the cache came back zeroed: no block holds anything
        return WakeResult(report, tuple(targets), self._resume_if_ready(ends_pause=True))

    def is_sleeping(self) -> bool:
        return self.sleep_mode is not None and self.sleep_mode.level is not None

    def reload_weights(self, path: str | None = None) -> None:
        """Load the weights again from `path` (default: the model's checkpoint) into the same tensors."""
        self._weights_awake("reload_weights")
        self.reset_prefix_cache()  # K/V computed with the old weights must not serve new requests
        self.model_runner.reload_weights(path or self.config.model)
        self._weights_restored()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy new weights, named as in the Hugging Face checkpoint, into the model (an RL trainer's
        push). After a level-2 sleep every weight must be given; otherwise any subset. Returns the count."""
        self._weights_awake("update_weights")
        strict = self.sleep_mode is not None and self.sleep_mode.weights_discarded
        self.reset_prefix_cache()  # K/V computed with the old weights must not serve new requests
        count = self.model_runner.update_weights(named_tensors, strict=strict)
        self._weights_restored()
        return count

    def memory_usage(self) -> dict:
        """Per-tag bytes and states, the sleep level, and the device memory in use."""
        mode = self._sleep_mode()
        return {"level": mode.level, "device_used_bytes": self.memory.device_used_bytes(),
                "weights_discarded": mode.weights_discarded,
                "tags": {tag: asdict(usage) for tag, usage in self.memory.usage().items()}}

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
            if (mode.level == 0 and not ends_pause) or self.memory.is_sleeping():
                return False
            mode.level = None
        if mode.weights_discarded:
            return False
        self.scheduler.resume()
        return True

    def _postprocess_text(self, seqs: list[Sequence]) -> list[RequestOutput]:
        finished = []
        for seq in seqs:
            text = self._texts.get(seq.seq_id)
            if text is None:  # aborted while its step ran
                continue
            stop = text.update(seq.output_token_ids)
            if stop is not None:
                if seq.is_finished:  # ended by this token anyway (eos, length): the stop string names it
                    seq.finish_reason, seq.stop_reason = "stop", stop
                else:
                    self.scheduler.finish(seq, "stop", stop)
            samples = self._samples.get(seq.request_id, ())
            if seq.is_finished and all(sample.is_finished for sample in samples):  # its request is done
                finished.append(self._request_output(samples))
        return finished


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
