"""Prompts from HTTP requests to token ids, off the event loop and bounded before the work.

Tokenizing a long text, or rendering a long conversation with a chat template, takes milliseconds to
seconds of CPU; on the event loop it stalls every other request and `/health`. Here it runs in a small
thread pool (the tokenizers library's batch call releases the GIL; a template render is Python and
shares it in 5 ms turns), except for short inputs, where the hop would cost more than the work.

Nothing unbounded is started: a request holds at most `max_prompts_per_request` prompts, and a text
longer than `max_model_len` times the longest token of the vocabulary (in characters; times 4 when the
tokenizer normalizes, since NFC may merge several code points into one) cannot fit in the context,
so it is refused by its length alone, before anything reads it (vLLM bounds prompt text the same way).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from torpor.engine.chat_template import ChatTemplateError
from torpor.server.errors import APIError

if TYPE_CHECKING:
    from fastapi import Request

    from torpor.engine.tokenizer import Tokenizer

INLINE_CHARS = 4096  # inputs this short are tokenized on the event loop (tens of microseconds)
NORMALIZER_SLACK = 4
T = TypeVar("T")


def prompts_of(request: Request) -> Prompts:
    """The app's `Prompts` (made by `build_app`)."""
    return request.app.state.prompts


class Prompts:
    """The server's tokenizer work: limits checked first, then the work in the pool (or inline)."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, max_prompts_per_request: int,
                 workers: int | None = None) -> None:
        self.tokenizer, self.max_model_len, self.max_prompts = tokenizer, max_model_len, max_prompts_per_request
        slack = NORMALIZER_SLACK if tokenizer.has_normalizer else 1
        self.max_chars = max_model_len * tokenizer.max_chars_per_token * slack
        # A couple of threads: enough that one long prompt does not queue the others, few enough that a
        # flood of prompts cannot take the CPU cores the engine runs on.
        self._pool = ThreadPoolExecutor(workers or min(4, max(1, (os.cpu_count() or 2) // 2)),
                                        thread_name_prefix="torpor-prompts")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def check_count(self, count: int, param: str) -> None:
        """400 naming `param` for a request of more prompts than `--max-prompts-per-request`."""
        if count > self.max_prompts:
            raise APIError(400, f"{param}: {count} prompts in one request; this server takes at most "
                                f"{self.max_prompts} (--max-prompts-per-request)", param=param,
                           code="too_many_prompts")

    def check_length(self, text: str, param: str) -> None:
        """400 naming `param` for a text too long to fit in the context whatever its tokens."""
        if len(text) > self.max_chars:
            raise APIError(400, f"{param}: the text has {len(text)} characters; this model's maximum context "
                                f"length is {self.max_model_len} tokens, at most {self.max_chars} characters of "
                                "text. Please reduce the length of the input.", param=param,
                           code="context_length_exceeded")

    async def encode(self, texts: list[str], add_special_tokens: bool, param: str) -> list[list[int]]:
        """The token ids of each text (one tokenizer call for them all), each checked for length first."""
        for text in texts:
            self.check_length(text, param)
        return await self.run(sum(map(len, texts)), self.tokenizer.encode_batch, texts, add_special_tokens)

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` for an input of `size` characters: inline when short, else in the pool."""
        if size <= INLINE_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def render(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
                     add_generation_prompt: bool, continue_final_message: bool, add_special_tokens: bool,
                     template_kwargs: dict[str, Any]) -> list[int]:
        """The conversation rendered with the model's chat template and tokenized; a rendering too long for
        the context is refused before it is tokenized. Template failures are 400s naming `messages`."""
        if continue_final_message and add_generation_prompt:
            raise APIError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                           param="continue_final_message")
        tokenizer = self.tokenizer

        def render() -> list[int]:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message, tools=tools,
                                                 **template_kwargs)
            self.check_length(text, "messages")
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)

        size = sum(len(message.get("content") or "") for message in conversation) + len(str(tools or ""))
        try:
            return await self.run(size, render)
        except ChatTemplateError as exc:
            raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
        except TypeError:  # a key of chat_template_kwargs naming an argument of the template call
            raise APIError(400, "chat_template_kwargs: a key names an argument of the template call",
                           param="chat_template_kwargs", code="unsupported_parameter") from None
        except ValueError as exc:  # no chat template
            raise APIError(400, f"{exc}: use /v1/completions with this model", param="messages",
                           code="no_chat_template") from None
