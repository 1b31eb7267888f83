"""OpenAI request bodies (pydantic) and their translation into prompt token ids and `SamplingParams`.

Unknown fields are ignored (clients send many); fields torpor cannot honour with a non-default value
(n > 1, penalties, logit_bias, echo, suffix, best_of, tools) are a 400 naming the field. `top_k`,
`ignore_eos` and `stop_token_ids` are accepted as extra fields, as vLLM does.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from torpor.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from torpor.server.errors import APIError

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI default for /v1/completions


class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

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
    # extras (vLLM's names)
    top_k: int | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None

    def check_supported(self) -> None:
        unsupported: dict[str, Any] = {"n": self.n not in (None, 1),
                                       "presence_penalty": self.presence_penalty not in (None, 0),
                                       "frequency_penalty": self.frequency_penalty not in (None, 0),
                                       "logit_bias": bool(self.logit_bias)}
        unsupported.update(self._unsupported())
        for field, refused in unsupported.items():
            if refused:
                value = getattr(self, field)
                hint = "; send one request per completion" if field == "n" else ""
                raise APIError(400, f"{field}={value!r} is not supported by torpor{hint}", param=field,
                               code="unsupported_parameter")

    def _unsupported(self) -> dict[str, bool]:
        return {}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Validated `SamplingParams`; a bad value is a 400 naming its field."""
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if self.top_k is None else self.top_k,
                max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                ignore_eos=bool(self.ignore_eos), seed=self.seed, logprobs=logprobs)
        except ValueError as exc:
            field = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc), param=field if field in type(self).model_fields else None) from None


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    return_token_ids: bool | None = False  # vLLM's extension: the choice carries "token_ids" (RL trainers)

    def _unsupported(self) -> dict[str, bool]:
        return {"echo": bool(self.echo), "suffix": bool(self.suffix), "best_of": self.best_of not in (None, 1)}

    def prompt_token_ids(self, tokenizer, vocab_size: int) -> list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, f"a batch of {len(prompt)} prompts is not supported; send one request "
                                    "per prompt", param="prompt", code="unsupported_parameter")
            prompt = prompt[0]
        token_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size}) (the model's vocabulary), got "
                                f"{bad[:5]}", param="prompt")
        return token_ids


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"content part of type {part.type!r} is not supported (text only)",
                               param=f"messages.{index}.content")
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None

    def _unsupported(self) -> dict[str, bool]:
        return {"tools": bool(self.tools)}

    def prompt_token_ids(self, tokenizer) -> list[int]:
        """The conversation rendered with the model's chat template, tokenized."""
        from jinja2.exceptions import TemplateError

        messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except ValueError as exc:  # no chat template
            raise APIError(400, f"{exc}: use /v1/completions with this model", param="messages",
                           code="no_chat_template") from None
        except TemplateError as exc:
            raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


def resolve_max_tokens(requested: int | None, default: int | None, num_prompt_tokens: int, max_model_len: int,
                       cap: int, param: str = "max_tokens") -> int:
    """The request's max_tokens, checked against the cap; the default fills what the context leaves."""
    if requested is None:
        room = max_model_len - num_prompt_tokens
        return max(1, min(cap, room if default is None else default))
    if isinstance(requested, int) and requested > cap:
        raise APIError(400, f"{param}={requested} exceeds this server's limit of {cap}", param=param,
                       code="max_tokens_exceeded")
    return requested


def check_prompt_length(num_prompt_tokens: int, max_model_len: int, param: str) -> None:
    if num_prompt_tokens >= max_model_len:
        raise APIError(400, f"the prompt has {num_prompt_tokens} tokens; it must be shorter than the model's "
                            f"context (max_model_len={max_model_len}) to leave room for an output token",
                       param=param, code="context_length_exceeded")


def check_logprobs(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"{param} must be in [0, {MAX_LOGPROBS}], got {value}", param=param)
