"""Chat templates rendered as Hugging Face renders them.

A checkpoint's `chat_template` is Jinja written for transformers' environment: `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension (`{% break %}`), the `{% generation %}` tag, a `tojson`
filter that does not HTML-escape and takes `indent` / `separators` / `sort_keys`, and the globals
`raise_exception(message)` and `strftime_now(format)`. Templates are untrusted text from the Hub, so they
run in Jinja's immutable sandbox. Every failure, at compile or render time, is a `ChatTemplateError`
(a ValueError) whose message names the template error.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

# transformers' marker for continue_final_message: it survives templates that strip message content.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """A chat template failed to compile or to render a conversation (or raised on purpose)."""


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict] | None = None,
                **template_kwargs: Any) -> str:
    """Render one conversation as `tokenizer.apply_chat_template(..., tokenize=False)` does.

    `template_kwargs` reach the template as variables (special tokens such as `bos_token`, and options
    such as Qwen3's `enable_thinking`). `continue_final_message` leaves the last message open (the model
    continues it) and cannot be combined with `add_generation_prompt`."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the first "
                         "continues the last message, the second starts a new one")
    chat = normalize_messages(messages)
    final = ""
    if continue_final_message:
        final = chat[-1].get("content") or ""
        chat[-1]["content"] = final + _CONTINUE_TAG
    compiled = _compile(template)
    try:
        text = compiled.render(messages=chat, tools=tools, documents=None,
                               add_generation_prompt=add_generation_prompt, **template_kwargs)
    except Exception as exc:  # any failure inside the template is the template's
        raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from exc
    if continue_final_message:
        tag = _CONTINUE_TAG.strip()
        if tag not in text or final.strip() not in text:
            raise ChatTemplateError("continue_final_message: the chat template drops the final message's text")
        at = text.rindex(tag)
        text = text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `messages` with OpenAI content parts joined into one string (text parts only, vLLM's
    "string" content format). ValueError names the first malformed message."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, "
                         f"got {messages!r:.80}")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role', got {message!r:.80}")
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise ValueError(f"messages[{i}].content: a part of type {kind!r} is not supported (text only)")
                texts.append(part["text"])
            message["content"] = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, a list of text parts or None, "
                             f"got {type(content).__name__}")
        chat.append(message)
    return chat


def load_chat_template(value: str) -> str:
    """`--chat-template`: the text of a file when `value` names one, else `value` itself if it is Jinja.
    ValueError when it is neither (a mistyped path must not become a template that prints the path)."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a name too long for a path is inline text
        pass
    if "{{" in value or "{%" in value:
        _compile(value)  # fail now, naming the error, not at the first request
        return value
    raise ValueError(f"chat template {value!r} is neither a file nor Jinja text")


@functools.lru_cache(maxsize=32)
def _compile(source: str):
    """The compiled template (cached: the server renders the same template for every request)."""
    import jinja2

    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {type(exc).__name__}: {exc}") from exc


@functools.cache
def _environment():
    """transformers' chat-template environment (utils/chat_template_utils.py), rebuilt here."""
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's tokens for training masks; when
        rendering for inference it renders its body."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller) -> str:
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """`namespace()` that refuses underscore names (no reach into CPython internals)."""

        def __init__(*args, **kwargs):  # Jinja's own signature trick: `namespace(self=...)` works
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot store {name!r} on a namespace")

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, namespace=Namespace,
                       dict=lambda *args, **kwargs: dict(*args, **kwargs))
    return env
