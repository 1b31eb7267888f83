"""OpenAI request bodies (pydantic) and their translation into `SamplingParams` (chat: chat_protocol.py).

Every option is honoured or refused with a 400 naming it (`code: "unsupported_parameter"`):
- `n` (samples per prompt; a list of prompts in /v1/completions is a batch), the penalties, `logit_bias`
  (token id strings -> [-100, 100]) and vLLM's extra sampling fields (`top_k`, `min_p`,
  `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`,
  `include_stop_str_in_output`) and SGLang's `return_routed_experts` (MoE models) go into `SamplingParams`; vLLM's
  token-level fields (`return_token_ids`,
  `return_tokens_as_token_ids`, `prompt_logprobs`, `echo`, `stream_options.continuous_usage_stats`)
  shape the response (responses.py);
- declared fields torpor cannot honour with a non-default value (suffix, best_of, response_format,
  prompt_logprobs=-1) are refused by `check_supported`;
- any other field at the top level is refused by `check_known_fields` — `functions`, `reasoning_effort`,
  a typo (`max_token`) — unless its value is null (no behaviour asked for) or it is on the allowlist of
  OpenAI fields that carry no semantics for a self-hosted engine: `IGNORED_FIELDS` (`user`, `metadata`,
  `store`, `service_tier`, `safety_identifier`, `prompt_cache_key`, `parallel_tool_calls`). Inside a
  chat message, fields torpor does not read are ignored, as vLLM ignores them (chat_protocol.py).
Types are strict: no lax cast changes a meaning (`prompt: [true, false]` is not the tokens [1, 0],
`max_tokens: true` not 1, `"0.5"` not a number), seeds fit in 64 bits (vLLM's bounds), and text must
be valid Unicode (a lone surrogate is a 400, not a tokenizer error).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from torpor.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from torpor.server.errors import APIError

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# OpenAI fields accepted and ignored: bookkeeping for OpenAI's platform, no effect on a generation.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                            "parallel_tool_calls"})


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the fields of `model` (and the models inside it) that it does not declare, set
    to something other than null and not in `IGNORED_FIELDS`. Models with `ignore_extra_fields` (chat
    messages and their parts: vLLM ignores what it does not read there) are not searched."""
    names = [f"{prefix}{name}" for name, value in (model.model_extra or {}).items()
             if value is not None and name not in IGNORED_FIELDS]
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, list) and not any(isinstance(item, BaseModel) for item in value[:1]):
            continue  # a list of values (a typed field's items share a kind): no model inside
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            if isinstance(item, BaseModel) and not getattr(item, "ignore_extra_fields", False):
                where = f"{prefix}{name}." if index is None else f"{prefix}{name}.{index}."
                names += unknown_fields(item, where)
    return names


_SCALARS = frozenset({int, float, bool, type(None)})


def invalid_unicode(value: Any, where: str = "") -> tuple[str, str] | None:
    """(dotted field name, the offending text) of the first string in `value` that is not valid
    Unicode (a lone surrogate such as "\\ud800" in the JSON), or None. (Lists of numbers, a prompt's token
    ids, are passed over in one C-level look at their element types: this runs for every request.)"""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return where, value[exc.start : exc.end]
        return None
    if isinstance(value, BaseModel):
        value = {**value.__dict__, **(value.model_extra or {})}
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list | tuple):
        if _SCALARS.issuperset(map(type, value)):
            return None
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if type(item) in _SCALARS:
            continue
        found = invalid_unicode(item, f"{where}.{key}" if where else str(key))
        if found is not None:
            return found
    return None


def check_unicode(value: Any) -> None:
    """400 naming the first string in `value` that is not valid Unicode."""
    bad = invalid_unicode(value)
    if bad is not None:
        where, text = bad
        raise APIError(400, f"{where}: invalid unicode: the text holds a lone surrogate {text!r} (a UTF-16 half that "
                            "encodes no character)", param=where, code="invalid_unicode")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: every chunk carries the usage so far


class GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    # strict: no lax casts (true is not 1, "0.5" not 0.5; an int is still a valid float); unknown fields are
    # kept in model_extra, where `check_known_fields` refuses them
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # vLLM's bounds: the sampler's seeds are 64-bit
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: Any = None
    # extras (vLLM's names)
    top_k: int | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    return_routed_experts: bool | None = None  # SGLang's name (MoE models): each choice's routed experts
    prompt_logprobs: int | None = None
    return_token_ids: bool | None = False  # the prompt's and the output's token ids in the response
    return_tokens_as_token_ids: bool | None = False  # logprob tokens as "token_id:N"

    def check_supported(self) -> None:
        unsupported: dict[str, Any] = {"response_format": self.response_format not in (None, {"type": "text"})}
        unsupported.update(self._unsupported())
        for field, refused in unsupported.items():
            if refused:
                raise APIError(400, f"{field}={getattr(self, field)!r} is not supported by torpor", param=field,
                               code="unsupported_parameter")
        if self.stream_options is not None and self.stream_options.model_dump(exclude_unset=True) and not self.stream:
            raise APIError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
        self._check_prompt_logprobs()

    def _check_prompt_logprobs(self) -> None:
        value = self.prompt_logprobs
        if value is None:
            return
        if self.stream and (value > 0 or value == -1):
            raise APIError(400, "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
        if value == -1:
            raise APIError(400, f"prompt_logprobs=-1 (the whole vocabulary) is not supported by torpor: ask for at "
                                f"most {MAX_LOGPROBS}", param="prompt_logprobs", code="unsupported_parameter")
        if value < 0:
            raise APIError(400, "`prompt_logprobs` must be a positive value or -1.", param="prompt_logprobs")
        check_logprobs(value, "prompt_logprobs")

    def _unsupported(self) -> dict[str, bool]:
        return {}

    def check_known_fields(self) -> None:
        """400 naming the first field torpor does not know (see the module docstring's policy), or the
        first string that is not valid Unicode."""
        unknown = unknown_fields(self)
        if unknown:
            raise APIError(400, f"unsupported field(s) {unknown}: torpor does not implement them (send only the "
                                "documented fields, or null)", param=unknown[0], code="unsupported_parameter")
        check_unicode(self)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.continuous_usage_stats)

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                        **overrides: Any) -> SamplingParams:
        """Validated `SamplingParams`; a bad value is a 400 naming its field. Unset fields keep
        `SamplingParams`' defaults; `overrides` win over the request's."""
        options = {name: value for name in _OPTIONAL_SAMPLING_FIELDS if (value := getattr(self, name)) is not None}
        try:
            return SamplingParams(**{
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p,
                "top_k": -1 if self.top_k is None else self.top_k,
                "max_tokens": max_tokens, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
                "ignore_eos": bool(self.ignore_eos), "seed": self.seed, "logprobs": logprobs,
                "prompt_logprobs": prompt_logprobs, "logit_bias": self._logit_bias(),
                "n": 1 if self.n is None else self.n, **options, **overrides})
        except ValueError as exc:
            field = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc), param=field if field in type(self).model_fields else None) from None

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's logit_bias keys are token ids written as strings."""
        if not self.logit_bias:
            return None
        try:
            return {int(key): value for key, value in self.logit_bias.items()}
        except ValueError:
            bad = [key for key in self.logit_bias if not key.strip().lstrip("+-").isdigit()]
            raise APIError(400, f"logit_bias keys must be token ids, got {bad[:5]}", param="logit_bias") from None


_OPTIONAL_SAMPLING_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
                             "skip_special_tokens", "include_stop_str_in_output", "return_routed_experts")


class CompletionRequest(GenerationRequest):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]  # strict: true is not token 1

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        """One clear message for a prompt of none of the four shapes (not one per union member)."""
        def token_ids(value: Any) -> bool:
            return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)

        if isinstance(prompt, str) or token_ids(prompt):
            return prompt
        if isinstance(prompt, list) and (all(isinstance(p, str) for p in prompt) or all(map(token_ids, prompt))):
            return prompt
        raise ValueError("prompt must be a string, a list of token ids (integers: true and false are not token "
                         f"ids), or a list of those; got {json.dumps(prompt)[:80]}")
    logprobs: int | None = None
    echo: bool | None = False  # the prompt before the output (text, token ids and logprobs)
    suffix: str | None = None
    best_of: int | None = None

    def _unsupported(self) -> dict[str, bool]:
        return {"suffix": bool(self.suffix), "best_of": self.best_of not in (None, 1)}

    def prompt_list(self) -> list[str | list[int]]:
        """The request's prompts: a list of strings or of token-id lists is a batch."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return list(prompt)
        return [prompt]

    def num_prompt_logprobs(self) -> int | None:
        """Prompt logprobs to compute: those asked for, or with `echo` the `logprobs` (vLLM's rule; the
        echoed prompt carries them)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None


def resolve_max_tokens(requested: int | None, default: int | None, num_prompt_tokens: int, max_model_len: int,
                       cap: int, param: str = "max_tokens", prompt_param: str = "prompt") -> int:
    """The request's max_tokens, checked against the cap and the context as vLLM's server checks them (a
    400, never a silent cut); the default fills what the context leaves."""
    if num_prompt_tokens >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your request "
                            f"has {num_prompt_tokens} input tokens. Please reduce the length of the input messages.",
                       param=prompt_param, code="context_length_exceeded")
    room = max_model_len - num_prompt_tokens
    if requested is None:
        return max(1, min(cap, room, room if default is None else default))
    if requested < 1:
        raise APIError(400, f"{param} must be at least 1, got {requested}", param=param)
    if requested > cap and cap < max_model_len:
        raise APIError(400, f"{param}={requested} exceeds this server's limit of {cap}", param=param,
                       code="max_tokens_exceeded")
    if requested > max_model_len:
        raise APIError(400, f"{param}={requested} cannot be greater than max_model_len={max_model_len}. Please "
                            "request fewer output tokens.", param=param, code="context_length_exceeded")
    if requested > room:
        raise APIError(400, f"You passed {num_prompt_tokens} input tokens and requested {requested} output tokens. "
                            f"However, the model's context length is only {max_model_len} tokens, resulting in a "
                            f"maximum input length of {max_model_len - requested} tokens. Please reduce the length of "
                            "the input prompt.", param=param, code="context_length_exceeded")
    return requested


def check_logprobs(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"{param} must be in [0, {MAX_LOGPROBS}], got {value}", param=param)
