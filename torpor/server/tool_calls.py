"""Tool calls in a model's output text, as vLLM's tool parsers find them (`--tool-call-parser NAME`).

`hermes`: the Hermes / Qwen format, a JSON object `{"name": ..., "arguments": {...}}` between
`<tool_call>` and `</tool_call>` (the closing tag may be missing at the end of the output). The text
before the first `<tool_call>` is the message's content; a call that is not such JSON makes the whole
output plain content, with no calls (vLLM's behaviour).

Streaming (`ToolCallStream`) re-reads the whole text so far at every step and sends what is new: content
up to the first tag (holding back a suffix that may begin one), then per call its name (with a fresh id),
then the growth of its `arguments` text as the model writes it (found by bracket matching, strings
respected, so the deltas add up to exactly the value the model wrote).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import ClassVar


def make_tool_call_id() -> str:
    """vLLM's tool-call ids: "chatcmpl-tool-" and a random hex string."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call(name: str, arguments: str) -> dict:
    return {"id": make_tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def partial_overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class ToolParser:
    """A tool-call format. `extract` reads a whole output; `stream` follows one as it grows."""

    name: ClassVar[str]

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a finished output; no calls: (the whole text, [])."""
        raise NotImplementedError

    def stream(self) -> ToolCallStream:
        raise NotImplementedError


class ToolCallStream:
    """The streaming state of one choice. `feed(text)` takes the whole text so far and returns what is
    new: (content delta, tool-call deltas in vLLM's shape)."""

    def __init__(self) -> None:
        self.called = False  # a tool call was sent (the stream then finishes with "tool_calls")

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """`final`: the output ended (a suffix held back because it might begin a tag goes out)."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def regions(self, text: str) -> list[tuple[str, bool]]:
        """(JSON text, complete) of each `<tool_call>` region; the last may be open (a partial closing
        tag withheld; complete if its JSON already parses)."""
        found, at = [], text.find(self.start)
        while at != -1:
            body_at = at + len(self.start)
            close = text.find(self.end, body_at)
            if close == -1:
                body = text[body_at:]
                body = body[: len(body) - partial_overlap(body, self.end)].strip()
                found.append((body, _is_json(body)))
                break
            found.append((text[body_at:close].strip(), True))
            at = text.find(self.start, close + len(self.end))
        return found

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        if self.start not in text:
            return text, []
        calls = []
        for body, _ in self.regions(text):
            try:
                call = json.loads(body)
                calls.append(tool_call(call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
            except (ValueError, TypeError, KeyError):  # not a call: the output is plain text
                return text, []
        return text[: text.index(self.start)] or None, calls

    def stream(self) -> ToolCallStream:
        return _HermesStream(self)


class _HermesStream(ToolCallStream):
    def __init__(self, parser: HermesToolParser) -> None:
        super().__init__()
        self.parser = parser
        self.content_sent = 0  # characters of content sent
        self.calls: list[list] = []  # per call: [name sent, arguments text sent]

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        start = self.parser.start
        end_of_content = text.find(start)
        if end_of_content == -1:
            end_of_content = len(text) - (0 if final else partial_overlap(text, start))
        content = ""
        if end_of_content > self.content_sent:
            content, self.content_sent = text[self.content_sent:end_of_content], end_of_content
        deltas: list[dict] = []
        for index, (body, complete) in enumerate(self.parser.regions(text)):
            if index == len(self.calls):
                name = _NAME.search(body)
                if name is None:
                    break  # this call's name is not complete yet; later calls wait for it
                self.calls.append([name.group(1), ""])
                deltas.append({"index": index, "id": make_tool_call_id(), "type": "function",
                               "function": {"name": name.group(1)}})
                self.called = True
            arguments = _arguments_text(body, complete)
            sent = self.calls[index][1]
            if arguments is not None and len(arguments) > len(sent):
                deltas.append({"index": index, "function": {"arguments": arguments[len(sent):]}})
                self.calls[index][1] = arguments
        return content, deltas


_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return bool(text)


def _arguments_text(body: str, complete: bool) -> str | None:
    """The text of the `arguments` value in a (possibly partial) call body: an object or array up to its
    matching bracket (all of it so far when still open), a scalar only once the call is complete."""
    found = _ARGUMENTS.search(body)
    if found is None:
        return None
    value = body[found.end():]
    if not value.startswith(("{", "[")):
        return value.rstrip().removesuffix("}").rstrip() if complete and value else None
    opening, closing = value[0], "}" if value[0] == "{" else "]"
    depth, in_string, escaped = 0, False, False
    for i, char in enumerate(value):
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char == opening:
            depth += 1
        elif char == closing:
            depth -= 1
            if depth == 0:
                return value[: i + 1]
    return value


TOOL_PARSERS: dict[str, type[ToolParser]] = {parser.name: parser for parser in (HermesToolParser,)}
