"""The engine loop: requests in, one scheduled batch per `step`, finished requests out."""

from __future__ import annotations

import itertools

from torpor.engine.config import EngineConfig
from torpor.engine.model_runner import ModelRunner
from torpor.engine.outputs import RequestOutput
from torpor.engine.sampling_params import SamplingParams
from torpor.engine.scheduler import Scheduler
from torpor.engine.sequence import Sequence
from torpor.engine.tokenizer import IncrementalDetokenizer, Tokenizer


class LLMEngine:
    """Tokenizer, scheduler and model runner; detokenizes outputs and applies stop strings."""

    def __init__(self, config: EngineConfig, memory=None) -> None:
        self.tokenizer = Tokenizer.from_pretrained(config.model)
        self.model_runner = ModelRunner(config, memory)
        self.config = self.model_runner.config  # with the profiled number of KV blocks
        model_config = self.model_runner.model_config
        self.vocab_size = model_config.vocab_size
        self.scheduler = Scheduler(self.config, model_config.eos_token_ids)
        self._texts: dict[str, _Text] = {}
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

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._texts.pop(request_id, None)

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule a batch, run it, record the tokens; returns the requests finished by this step."""
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return []
        output = self.model_runner.run(seqs, is_prefill)
        self.scheduler.postprocess(seqs, output.token_ids, output.logprobs)
        return self._postprocess_text(seqs)

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
