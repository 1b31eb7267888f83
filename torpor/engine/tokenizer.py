"""Tokenizer of a Hugging Face checkpoint folder: `tokenizer.json` (the `tokenizers` library) plus
`tokenizer_config.json` (special tokens, chat template)."""

import itertools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tokenizers


class Tokenizer:
    """encode / decode / chat template. Ids the tokenizer does not know (a model vocab is often padded
    beyond it, and synthetic models generate such ids) decode to the placeholder `<unk_ID>`."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, config: dict[str, Any], chat_template: str | None = None):
        self._tokenizer = tokenizer
        self.config = config
        self.chat_template = chat_template
        self._known_ids = frozenset(tokenizer.get_vocab(with_added_tokens=True).values())
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.bos_token_id = self._special_id(self.bos_token)
        self.eos_token_id = self._special_id(self.eos_token)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").is_file():  # newer checkpoints keep it in its own file
            template = (path / "chat_template.jinja").read_text()
        return cls(tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")), config, template)

    @property
    def vocab_size(self) -> int:
        """One past the largest id the tokenizer knows."""
        return max(self._known_ids) + 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the tokenizer's template adds (e.g. bos)."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = list(token_ids)
        if all(i in self._known_ids for i in ids):
            return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        parts = []
        for known, group in itertools.groupby(ids, key=self._known_ids.__contains__):
            group = list(group)
            if known:
                parts.append(self._tokenizer.decode(group, skip_special_tokens=skip_special_tokens))
            else:
                parts.extend(f"<unk_{i}>" for i in group)
        return "".join(parts)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False,
                            chat_template: str | None = None, continue_final_message: bool = False,
                            tools: list[dict] | None = None, **template_kwargs) -> str | list[int]:
        """Render `messages` ([{"role": ..., "content": ...}]) with the checkpoint's Jinja chat template (or
        `chat_template`) as Hugging Face does (see chat_template.py); the token ids of the result with
        `tokenize` (special tokens come from the template only). `template_kwargs` reach the template
        (e.g. Qwen3's `enable_thinking=False`). ValueError without a template; `ChatTemplateError` (a
        ValueError naming the template error) when the template fails."""
        from torpor.engine.chat_template import render_chat

        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json has no chat_template)")
        special = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        text = render_chat(template, messages, add_generation_prompt, continue_final_message, tools,
                           **{**special, **template_kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def convert_ids_to_tokens(self, token_ids: Iterable[int]) -> list[str | None]:
        """The vocabulary entries of `token_ids` (e.g. "Ġhello"); None for ids the tokenizer does not know."""
        return [self._tokenizer.id_to_token(i) for i in token_ids]

    def _special_id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)


class IncrementalDetokenizer:
    """Text deltas of a growing list of generated ids. Byte-level tokens can end inside a UTF-8
    character; such text (ending in U+FFFD) is held back until the character is complete."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # start of a short window decoded for context
        self._read_offset = 0  # ids before this have been emitted

    def step(self, token_id: int) -> str:
        """Add one id; return the new text it completes (possibly "")."""
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
        full = decode(self.token_ids[self._prefix_offset :], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return full[len(prefix) :]


def _token_content(token: str | dict | None) -> str | None:
    return token.get("content") if isinstance(token, dict) else token

