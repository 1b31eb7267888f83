"""Per-request sampling parameters (vLLM-compatible names and meanings)."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20
# Temperatures below this are treated as greedy: dividing logits by ~0 only overflows.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    temperature: 0 (or below 1e-5) means greedy (argmax, deterministic).
    top_p: nucleus sampling, in (0, 1]; 1 disables it.
    top_k: keep the k most likely tokens; -1 disables it (0 is rejected, so a typo cannot
        silently mean "off").
    max_tokens: output tokens at most (the sequence also stops at the engine's max_model_len).
    stop: string(s) that end the output when they appear in the text (excluded from the text).
    stop_token_ids: token ids that end the output (applied even with ignore_eos).
    ignore_eos: keep generating past the model's end-of-sequence tokens.
    seed: makes sampling reproducible per request, whatever else shares the batch. Any int;
        unseeded requests get a seed from the engine's seed in arrival order.
    logprobs: for every output token return the chosen token's logprob plus the top `logprobs`
        (0 = the chosen token only); None = no logprobs. At most 20.
    prompt_logprobs: the same for every prompt token after the first.
    n: completions to sample from the prompt (>= 1; the engine caps it at `EngineConfig.max_n`). The
        prompt is computed once and its KV blocks shared; sample i draws from its own seed stream.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        # Normalise the list-like fields to tuples so the params stay hashable and immutable.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        _check_int("top_k", self.top_k)
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id)
            if token_id < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {token_id}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None:
            _check_int("seed", self.seed)
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] or None, got {value}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_filter(self) -> bool:
        """Whether top-k or top-p removes any token (sampling then has to sort the vocabulary)."""
        return not self.is_greedy and (self.top_k != -1 or self.top_p < 1.0)


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
