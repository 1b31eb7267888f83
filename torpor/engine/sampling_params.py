"""Per-request sampling parameters (vLLM-compatible names and meanings)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

MAX_LOGPROBS = 20
MAX_PENALTY = 2.0       # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI, vLLM)
MAX_LOGIT_BIAS = 100.0  # logit_bias values lie in [-100, 100] (OpenAI)
# Temperatures below this are treated as greedy: dividing logits by ~0 only overflows.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    temperature: 0 (or below 1e-5) means greedy (argmax, deterministic).
    top_p: nucleus sampling, in (0, 1]; 1 disables it.
    top_k: keep the k most likely tokens, and any as likely as the k-th (vLLM, transformers); -1 disables
        it (0 is rejected, so a typo cannot silently mean "off").
    max_tokens: output tokens at most (the sequence also stops at the engine's max_model_len).
    stop: string(s) that end the output when they appear in the text (excluded from the text).
    stop_token_ids: token ids that end the output (applied even with ignore_eos). The token that ends it,
        like an eos token, stays in the output's token ids but adds no text (vLLM).
    ignore_eos: keep generating past the model's end-of-sequence tokens.
    seed: makes sampling reproducible per request, whatever else shares the batch. Any int;
        unseeded requests get a seed from the engine's seed in arrival order.
    logprobs: for every output token return the chosen token's logprob plus the top `logprobs`
        (0 = the chosen token only); None = no logprobs. At most 20.
    prompt_logprobs: the same for every prompt token after the first.
    repetition_penalty: > 0; 1 disables it. Every token of the prompt or the output so far has its
        logit divided by it when positive, multiplied by it when negative (vLLM, transformers).
    presence_penalty: in [-2, 2]; subtracted once from the logit of every token the output holds (OpenAI).
    frequency_penalty: in [-2, 2]; subtracted from a token's logit once per time the output holds it.
    min_p: in [0, 1]; drops tokens whose probability (after temperature) is below min_p times the most
        likely token's; 0 disables it.
    min_tokens: the end-of-sequence tokens and stop_token_ids cannot be sampled, and stop strings do not
        end the output, before this many output tokens (at most max_tokens).
    skip_special_tokens: leave special tokens out of the output text.
    include_stop_str_in_output: keep the stop string that ended the output at the end of the text (or the
        text of the eos / stop_token_ids token that ended it).
    logit_bias: token id -> value in [-100, 100] added to its logit before everything else (the ids are
        checked against the vocabulary when the request is made). Stored as sorted (id, value) pairs.

    Penalties, logit_bias and min_tokens also steer greedy decoding (they change the argmax); logprobs
    stay those of the model's raw logits.
    n: completions to sample from the prompt (>= 1; the engine caps it at `EngineConfig.max_n`). The
        prompt is computed once and its KV blocks shared; sample i draws from its own seed stream.
    return_routed_experts: MoE models only: each completion's `routed_experts`, the experts every sparse layer
        chose for each output token (see torpor/engine/routed_experts.py for the format).
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
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None
    n: int = 1
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        # Normalise the list-like fields to tuples so the params stay hashable and immutable.
        stop = (self.stop,) if isinstance(self.stop, str) else _items("stop", self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", _items("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
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
        self._validate_penalties()

    def _validate_penalties(self) -> None:
        r = self.repetition_penalty
        if not _is_finite(r) or r <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        if not _is_finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("skip_special_tokens", "include_stop_str_in_output", "return_routed_experts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for token_id, bias in self.logit_bias:
            if token_id < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token_id}")
            if not _is_finite(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                 f"got {bias!r} for token {token_id}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_filter(self) -> bool:
        """Whether top-k or top-p removes any token (sampling then has to sort the vocabulary)."""
        return not self.is_greedy and (self.top_k != -1 or self.top_p < 1.0)

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the tokens so far (a penalty is on)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @cached_property
    def needs_logits_processing(self) -> bool:
        """Whether the logits change before temperature (penalties, logit_bias, min_tokens); requests
        without any of these take the sampler's unchanged fast path (cached: the check runs per step)."""
        return self.needs_history or bool(self.logit_bias) or self.min_tokens > 0

    def check_vocab(self, vocab_size: int) -> None:
        """OutOfVocabulary (a ValueError naming its `field`) when logit_bias or stop_token_ids names a token
        outside the model's vocabulary (min_tokens masks the stop tokens by index: such an id would fail the
        whole step)."""
        fields = {"logit_bias": [token_id for token_id, _ in self.logit_bias], "stop_token_ids": self.stop_token_ids}
        for field, ids in fields.items():
            bad = [token_id for token_id in ids if token_id >= vocab_size]
            if bad:
                what = "logit_bias token ids" if field == "logit_bias" else field
                raise OutOfVocabulary(f"{what} must be in [0, {vocab_size}) (the vocabulary), got {bad[:5]}", field)


class OutOfVocabulary(ValueError):
    """A token id beyond the model's vocabulary; `field` names the parameter that holds it."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def _is_finite(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def _bias_pairs(bias: Mapping[int, float] | Iterable[tuple[int, float]] | None) -> tuple[tuple[int, float], ...]:
    """logit_bias as (token id, value) pairs sorted by id; ValueError unless a mapping or pairs."""
    if bias is None:
        return ()
    try:
        pairs = [tuple(p) for p in (bias.items() if isinstance(bias, Mapping) else bias)]
    except TypeError:
        raise ValueError(f"logit_bias must map token ids to values, got {bias!r}") from None
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"logit_bias must map token ids to values, got {bias!r}")
    ids = [token_id for token_id, _ in pairs]
    if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
        raise ValueError(f"logit_bias token ids must be ints, got {ids[:5]}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"logit_bias names a token id twice: {sorted(ids)[:10]}")
    return tuple(sorted(pairs))


def _items(name: str, value: object) -> tuple:
    """A list-like field as a tuple (None: empty); ValueError naming it for a scalar or a mapping."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        try:
            return tuple(value)
        except TypeError:
            pass
    raise ValueError(f"{name} must be a list, got {value!r}")


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
