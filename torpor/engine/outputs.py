"""What `LLM.generate` returns: vLLM-shaped request and completion outputs (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from torpor.engine.sequence import FinishReason, TokenLogprobs

if TYPE_CHECKING:
    from torpor.engine.sequence import Sequence

__all__ = ["CompletionOutput", "FinishReason", "RequestOutput", "TokenLogprobs", "WeightVersionSpan"]


@dataclass(frozen=True)
class WeightVersionSpan:
    """vLLM's weight-version span: output tokens [start, end) were sampled by the weights labelled `version` (the
    label an update or `update_weight_version` set; "default" before any)."""

    version: str
    start: int
    end: int


@dataclass
class CompletionOutput:
    """One generated completion of a request."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None          # one entry per token of token_ids
    finish_reason: FinishReason | None            # None while the request still runs
    stop_reason: int | str | None = None          # the stop token id or stop string that ended it
    # vLLM's: the sum of the sampled tokens' logprobs when logprobs were asked for, else None.
    cumulative_logprob: float | None = None
    # Streaming: the text and tokens new since this request's previous output (text that may begin a
    # stop string is held back until resolved). The deltas of all outputs add up to `text` / `token_ids`.
    delta_text: str = ""
    delta_start: int = 0                          # token_ids[delta_start:] are the new tokens
    # return_routed_experts (MoE): numpy [len(token_ids), moe layers, top_k], the experts each token's forward pass
    # chose (format: torpor/engine/routed_experts.py); None otherwise
    routed_experts: np.ndarray | None = None
    # Once finished (vLLM's): the weights that sampled each span of token_ids, in order ([] without tokens); a
    # request paused with mode "keep" across a weight update gets two spans. None while it runs.
    weight_versions: list[WeightVersionSpan] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def delta_token_ids(self) -> list[int]:
        return self.token_ids[self.delta_start:]

    @property
    def delta_logprobs(self) -> list[TokenLogprobs] | None:
        return None if self.logprobs is None else self.logprobs[self.delta_start:]

    @property
    def delta_routed_experts(self) -> np.ndarray | None:
        return None if self.routed_experts is None else self.routed_experts[self.delta_start:]


@dataclass
class RequestOutput:
    """A request's prompt and its completion(s)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprobs | None] | None   # first entry None: nothing precedes it
    outputs: list[CompletionOutput]                      # n completions, in index order
    finished: bool
    num_cached_tokens: int = 0                           # prompt tokens found in the prefix cache (vLLM's)

    @classmethod
    def from_sequence(cls, seq: Sequence, text: str) -> RequestOutput:
        """Snapshot a one-sample request `seq` with its detokenized output `text`."""
        return cls.from_sequences([seq], [text])

    @classmethod
    def from_sequences(cls, seqs: list[Sequence], texts: list[str], delta_texts: list[str] | None = None,
                       delta_starts: list[int] | None = None) -> RequestOutput:
        """Snapshot the samples of one request (index order) with their detokenized texts and, streaming, what
        is new since the last snapshot (the engine owns detokenization)."""
        first = seqs[0]
        want_logprobs = first.sampling_params.logprobs is not None
        delta_texts = delta_texts or [""] * len(seqs)
        delta_starts = delta_starts or [0] * len(seqs)
        completions = [CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=seq.output_token_ids,
            logprobs=list(seq.output_logprobs) if want_logprobs else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            cumulative_logprob=seq.cumulative_logprob if want_logprobs else None,
            delta_text=delta_text,
            delta_start=delta_start,
            routed_experts=None if seq.routed_experts is None else _routed_rows(seq),
            weight_versions=[WeightVersionSpan(*span) for span in seq.weight_version_spans()]
            if seq.is_finished else None,
        ) for seq, text, delta_text, delta_start in zip(seqs, texts, delta_texts, delta_starts, strict=True)]
        return cls(
            request_id=first.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=first.prompt_logprobs,
            outputs=completions,
            finished=all(seq.is_finished for seq in seqs),
            num_cached_tokens=first.num_prefix_cached_tokens,
        )


def _routed_rows(seq: Sequence) -> np.ndarray:
    """The sequence's routed experts, one row per output token (a view: the rows are never written again)."""
    rows = seq.routed_experts.rows()
    return rows if rows is not None else np.zeros((0, 0, 0), dtype=np.int16)  # no token yet (aborted while queued)
