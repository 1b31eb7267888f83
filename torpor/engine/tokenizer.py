"""Tokenizer of a Hugging Face checkpoint folder: `tokenizer.json` (the `tokenizers` library) plus
`tokenizer_config.json` (special tokens, chat template)."""

import functools
import itertools
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
import tokenizers.decoders

from torpor.engine.chat_template import render_chat
from torpor.engine.models.config import read_json_object

if TYPE_CHECKING:
    from torpor.engine.sampling_params import SamplingParams


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
        """ValueError naming the file for a tokenizer.json the tokenizers library rejects, or a
        tokenizer_config.json that is not a JSON object or holds mistyped special tokens or templates."""
        path = Path(path)
        file, config_file = path / "tokenizer.json", path / "tokenizer_config.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        try:
            config = read_json_object(config_file) if config_file.is_file() else {}
            template = _default_template(config.get("chat_template"))
            for key in ("bos_token", "eos_token"):
                if not isinstance(_token_content(config.get(key)), str | None):
                    raise ValueError(f"{key} must be a string or an object with a string content")
        except ValueError as e:
            raise ValueError(f"{config_file}: {e}") from None
        if (path / "chat_template.jinja").is_file():  # newer checkpoints keep it in its own file
            template = (path / "chat_template.jinja").read_text()
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers library raises a plain Exception
            raise ValueError(f"{file}: not a tokenizers file ({str(e)[:200]})") from None
        return cls(tokenizer, config, template)

    @property
    def vocab_size(self) -> int:
        """One past the largest id the tokenizer knows."""
        return max(self._known_ids) + 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the tokenizer's template adds (e.g. bos)."""
        return self.encode_batch([text], add_special_tokens)[0]

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text. The tokenizers library's batch call releases the GIL while it works
        (its single `encode` holds it: a 1 MB text then stops every other thread for a second) and skips
        the character offsets nobody reads here (several times faster)."""
        return [encoding.ids for encoding in self._encode_batch(texts, add_special_tokens=add_special_tokens)]

    @functools.cached_property
    def _encode_batch(self):
        return getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)  # fast: tokenizers>=0.21

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The most characters one token of the vocabulary spells (added tokens included). A text longer
        than n times this, normalized, cannot fit in n tokens (vLLM bounds prompts the same way)."""
        return max(map(len, self._tokenizer.get_vocab(with_added_tokens=True)), default=1)

    @property
    def has_normalizer(self) -> bool:
        """Whether text is normalized (e.g. NFC) before tokenizing: that may merge characters."""
        return self._tokenizer.normalizer is not None

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = list(token_ids)
        if self._known_ids.issuperset(ids):  # (one C call: decode runs per token for incremental texts)
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

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (OpenAI's logprobs `bytes`): a byte-fallback token
        `<0xNN>` is that byte, a byte-level (GPT-2 style) token the bytes its characters map to, even
        when they end inside a UTF-8 character; any other token the UTF-8 of its text."""
        token = self._tokenizer.id_to_token(token_id) if token_id in self._known_ids else None
        if token is not None:
            fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", token)
            if fallback:
                return bytes([int(fallback.group(1), 16)])
            table = _byte_level_decoder()
            if isinstance(self._tokenizer.decoder, tokenizers.decoders.ByteLevel) and all(c in table for c in token):
                return bytes(table[c] for c in token)
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")


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


class OutputText:
    """The output text of one request: detokenized once, here, token by token, and cut before the
    first stop string. `delta()` hands out the text not handed out yet; while the request runs, the last
    (longest stop string - 1) characters are held back, since they may begin a stop string.

    Without stop strings and without streaming (`incremental=False`) nothing is decoded until the end:
    `final` decodes the whole output once."""

    def __init__(self, tokenizer: Tokenizer, params: "SamplingParams", incremental: bool = False) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(params.stop)
        self.skip_special_tokens, self.min_tokens = params.skip_special_tokens, params.min_tokens
        self.keep_stop = params.include_stop_str_in_output  # the text ends after the stop string, not before
        self.incremental = incremental or bool(self.stop)
        self.detokenizer = IncrementalDetokenizer(tokenizer, self.skip_special_tokens)
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # detokenized so far (incremental only), cut before a stop string once found
        self.stop_found: str | None = None
        self.num_emitted = 0  # characters handed out by `delta`

    def update(self, output_token_ids: list[int]) -> str | None:
        """Detokenize the tokens not seen yet; returns the stop string found by them (the text then ends
        before it), else None."""
        if not self.incremental or self.stop_found is not None:
            return None
        for token_id in output_token_ids[len(self.detokenizer.token_ids):]:
            delta = self.detokenizer.step(token_id)
            if not delta:
                continue
            old_length = len(self.text)
            self.text += delta
            if len(self.detokenizer.token_ids) <= self.min_tokens:
                continue  # stop strings count only after min_tokens output tokens (vLLM)
            # Only a stop string that ends in the delta counts: it may begin up to len(s) - 1 characters
            # before it (not earlier: text of the first min_tokens tokens is not searched again).
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, max(0, old_length - len(s) + 1))) != -1]
            if hits:
                index, self.stop_found = min(hits)
                self.text = self.text[:index + len(self.stop_found) if self.keep_stop else index]
                return self.stop_found
        return None

    def final(self, output_token_ids: list[int]) -> str:
        """The finished text; without a stop string, a full decode (it includes any bytes the incremental
        detokenizer still held back for an unfinished character)."""
        if self.stop_found is not None:
            return self.text
        return self.tokenizer.decode(output_token_ids, self.skip_special_tokens)

    def delta(self, final_text: str | None = None) -> str:
        """Text not handed out yet: what is safe while the request runs, everything left of `final_text`
        once it is finished (the concatenated deltas then equal the final text)."""
        if final_text is not None:
            end, source = len(final_text), final_text
        else:
            end, source = len(self.text) - self.hold_back, self.text
        if end <= self.num_emitted:
            return ""
        delta, self.num_emitted = source[self.num_emitted:end], end
        return delta
@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the
    others for the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


def _token_content(token: str | dict | None) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _default_template(template: object) -> str | None:
    """tokenizer_config.json's chat_template: a template, or a list of named ones (the default is used)."""
    if isinstance(template, list):  # named templates: use the default one
        if not all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in template):
            raise ValueError("chat_template must be a template or a list of {name, template} objects")
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str | None):
        raise ValueError(f"chat_template must be a template or a list of {{name, template}} objects, "
                         f"got a {type(template).__name__}")
    return template

