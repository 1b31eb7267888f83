"""What `LLM.generate` returns: vLLM-shaped request and completion outputs (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torpor.engine.sequence import Sequence

FinishReason = Literal["stop", "length", "abort"]
# Logprobs of one position: token id -> logprob for the top-k tokens plus the actual token
# (the chosen output token, or the real next prompt token). Values are float32 rounded to float.
TokenLogprobs = dict[int, float]


@dataclass
class CompletionOutput:
    """One generated completion of a request."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None          # one entry per token of token_ids
    finish_reason: FinishReason | None            # None while the request still runs
    stop_reason: int | str | None = None          # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
        """Snapshot `seq` with its detokenized output `text` (the engine owns detokenization)."""
        return cls.from_sequences([seq], [text])

    @classmethod
    def from_sequences(cls, seqs: list[Sequence], texts: list[str]) -> RequestOutput:
        """Snapshot the samples of one request (index order) with their detokenized texts."""
        first = seqs[0]
        want_logprobs = first.sampling_params.logprobs is not None
        completions = [CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=seq.output_token_ids,
            logprobs=list(seq.output_logprobs) if want_logprobs else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        ) for seq, text in zip(seqs, texts, strict=True)]
        return cls(
            request_id=first.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=first.prompt_logprobs,
            outputs=completions,
            finished=all(seq.is_finished for seq in seqs),
            num_cached_tokens=first.num_prefix_cached_tokens,
        )
