"""OpenAI request bodies (pydantic) and their translation into prompt token ids and `SamplingParams`.

Every option is honoured or refused with a 400 naming it (`code: "unsupported_parameter"`):
- `n` (samples per prompt; a list of prompts in /v1/completions is a batch), the penalties, `logit_bias`
  (token id strings -> [-100, 100]) and vLLM's extra sampling fields (`top_k`, `min_p`,
  `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`,
  `include_stop_str_in_output`) and SGLang's `return_routed_experts` (MoE models) go into `SamplingParams`;
- declared fields torpor cannot honour with a non-default value (echo, suffix, best_of,
  response_format, tools, tool_choice) are refused by `check_supported`;
- any other field, at the top level, in a message or in a content part, is refused by
  `check_known_fields` — `functions`, `reasoning_effort`, a typo
  (`max_token`) — unless its value is null (no behaviour asked for) or it is on the allowlist of
  OpenAI fields that carry no semantics for a self-hosted engine: `IGNORED_FIELDS` (`user`, `metadata`,
  `store`, `service_tier`, `safety_identifier`, `prompt_cache_key`, `parallel_tool_calls`).
Types are strict:
no lax cast changes a meaning (`prompt: [true, false]` is not the tokens [1, 0], `max_tokens: true`
not 1, `"0.5"` not a number), and text must be valid Unicode (a lone surrogate is a 400, not a
tokenizer error).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from torpor.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from torpor.server.errors import APIError

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
# OpenAI fields accepted and ignored: bookkeeping for OpenAI's platform, no effect on a generation.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                            "parallel_tool_calls"})


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the fields of `model` (and the models inside it) that it does not declare, set
    to something other than null and not in `IGNORED_FIELDS`."""
    names = [f"{prefix}{name}" for name, value in (model.model_extra or {}).items()
             if value is not None and name not in IGNORED_FIELDS]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            if isinstance(item, BaseModel):
                where = f"{prefix}{name}." if index is None else f"{prefix}{name}.{index}."
                names += unknown_fields(item, where)
    return names


def invalid_unicode(value: Any, where: str = "") -> tuple[str, str] | None:
    """(dotted field name, the offending text) of the first string in `value` that is not valid
    Unicode (a lone surrogate such as "\\ud800" in the JSON), or None."""
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
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = invalid_unicode(item, f"{where}.{key}" if where else str(key))
        if found is not None:
            return found
    return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


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
    seed: int | None = None
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

    def check_supported(self) -> None:
        unsupported: dict[str, Any] = {"response_format": self.response_format not in (None, {"type": "text"})}
        unsupported.update(self._unsupported())
        for field, refused in unsupported.items():
            if refused:
                raise APIError(400, f"{field}={getattr(self, field)!r} is not supported by torpor", param=field,
                               code="unsupported_parameter")

    def _unsupported(self) -> dict[str, bool]:
        return {}

    def check_known_fields(self) -> None:
        """400 naming the first field torpor does not know (see the module docstring's policy), or the
        first string that is not valid Unicode."""
        unknown = unknown_fields(self)
        if unknown:
            raise APIError(400, f"unsupported field(s) {unknown}: torpor does not implement them (send only the "
                                "documented fields, or null)", param=unknown[0], code="unsupported_parameter")
        bad = invalid_unicode(self)
        if bad is not None:
            where, text = bad
            raise APIError(400, f"{where}: invalid unicode: the text holds a lone surrogate {text!r} (a UTF-16 "
                                "half that encodes no character)", param=where, code="invalid_unicode")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Validated `SamplingParams`; a bad value is a 400 naming its field. Unset fields keep
        `SamplingParams`' defaults."""
        options = {name: value for name in _OPTIONAL_SAMPLING_FIELDS if (value := getattr(self, name)) is not None}
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if self.top_k is None else self.top_k,
                max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                ignore_eos=bool(self.ignore_eos), seed=self.seed, logprobs=logprobs,
                logit_bias=self._logit_bias(), n=1 if self.n is None else self.n, **options)
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
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    return_token_ids: bool | None = False  # vLLM's extension: the choice carries "token_ids" (RL trainers)

    def _unsupported(self) -> dict[str, bool]:
        return {"echo": bool(self.echo), "suffix": bool(self.suffix), "best_of": self.best_of not in (None, 1)}

    def prompts_token_ids(self, tokenizer) -> list[list[int]]:
        """The token ids of each prompt of the request (a list of strings or of token-id lists is a batch;
        the engine validates them: `LLMEngine.make_sequence`)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return [self.prompt_token_ids(tokenizer, p) for p in prompt]
        return [self.prompt_token_ids(tokenizer)]

    def prompt_token_ids(self, tokenizer, prompt: str | list[int] | None = None) -> list[int]:
        """The token ids of `prompt` (default: the request's single prompt)."""
        prompt = self.prompt if prompt is None else prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            raise APIError(400, "prompt must be a string, a list of token ids, or a list of either",
                           param="prompt")
        token_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids or prompt == "":
            raise APIError(400, "the prompt is empty", param="prompt")
        return token_ids


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[ContentPart] | None = None

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for number, part in enumerate(self.content):
            param = f"messages.{index}.content.{number}"
            if part.type != "text":
                raise APIError(400, f"content part of type {part.type!r} is not supported (text only)",
                               param=f"messages.{index}.content")
            if part.text is None:
                raise APIError(400, f"{param}: a content part of type 'text' needs a string 'text', got null",
                               param=f"{param}.text")
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra, e.g. {"enable_thinking": false}
    tool_choice: Any = None

    def _unsupported(self) -> dict[str, bool]:
        return {"tools": bool(self.tools), "tool_choice": self.tool_choice not in (None, "none")}

    def prompt_token_ids(self, tokenizer) -> list[int]:
        """The conversation rendered with the model's chat template, tokenized."""
        from torpor.engine.chat_template import ChatTemplateError

        messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 **template_kwargs(self.chat_template_kwargs))
        except ChatTemplateError as exc:
            raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
        except TypeError as exc:  # chat_template_kwargs naming one of the template's own arguments
            raise APIError(400, f"chat_template_kwargs: {exc}", param="chat_template_kwargs") from None
        except ValueError as exc:  # no chat template
            raise APIError(400, f"{exc}: use /v1/completions with this model", param="messages",
                           code="no_chat_template") from None

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


def resolve_max_tokens(requested: int | None, default: int | None, num_prompt_tokens: int, max_model_len: int,
                       cap: int, param: str = "max_tokens") -> int:
    """The request's max_tokens, checked against the cap; the default fills what the context leaves (the
    engine refuses a prompt + max_tokens beyond max_model_len)."""
    if requested is None:
        room = max_model_len - num_prompt_tokens
        return max(1, min(cap, room, room if default is None else default))
    if isinstance(requested, int) and requested < 1:
        raise APIError(400, f"{param} must be at least 1, got {requested}", param=param)
    if isinstance(requested, int) and requested > cap:
        raise APIError(400, f"{param}={requested} exceeds this server's limit of {cap}", param=param,
                       code="max_tokens_exceeded")
    return requested


# The template call's own arguments: chat_template_kwargs are template variables and may not set these
# (a `chat_template` from a request would run the client's Jinja code in the server's event loop).
TEMPLATE_CALL_ARGUMENTS = frozenset({"messages", "chat_template", "tokenize", "add_generation_prompt",
                                     "continue_final_message", "tools"})


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's `chat_template_kwargs`, refused with a 400 if one names an argument of the template call."""
    clashing = sorted(TEMPLATE_CALL_ARGUMENTS & set(kwargs or {}))
    if clashing:
        raise APIError(400, f"chat_template_kwargs may not set {clashing}: they are arguments of the template call, "
                            "not template variables (a request cannot bring its own chat template)",
                       param="chat_template_kwargs", code="unsupported_parameter")
    return dict(kwargs or {})


def check_logprobs(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"{param} must be in [0, {MAX_LOGPROBS}], got {value}", param=param)
