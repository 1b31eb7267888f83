"""The chat completion request: messages as OpenAI validates them, tools and tool_choice as vLLM takes
them, and the conversation handed to the chat template (vLLM's).

Messages: every message needs `content` (a string, or text parts), except an assistant message that
carries `tool_calls`. Besides `role` and `content` a message may carry `name`, `tool_calls` (assistant:
`[{"id", "type": "function", "function": {"name", "arguments": JSON text}}]`), `tool_call_id` (tool) and
`reasoning` / `reasoning_content` (assistant); these reach the template, `arguments` parsed into an
object as vLLM passes them (tool-use templates expect one). Other fields of a message or a content part
are ignored, as vLLM ignores them.

Tools: `tools` reach the template as `[{"type": "function", "function": {"name", "description",
"parameters"}}]`. `tool_choice` defaults to "auto" when tools are given, else "none"; "auto" needs the
server's `--enable-auto-tool-choice` and `--tool-call-parser` (vLLM's error otherwise) and the output is
then read for tool calls; "none" renders the tools but reads no calls. "required" and a named function
are refused: vLLM forces them with guided decoding, which torpor does not have.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from torpor.server.errors import APIError
from torpor.server.protocol import GenerationRequest

# The template call's own arguments: chat_template_kwargs are template variables and may not set these
# (a `chat_template` from a request would run the client's Jinja code in the server).
TEMPLATE_CALL_ARGUMENTS = frozenset({"messages", "chat_template", "template", "tokenize", "add_generation_prompt",
                                     "continue_final_message", "tools"})
TOOL_CHOICES = ("none", "auto", "required")
AUTO_TOOLS_OFF = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's `chat_template_kwargs`, refused with a 400 if one names an argument of the template call."""
    clashing = sorted(TEMPLATE_CALL_ARGUMENTS & set(kwargs or {}))
    if clashing:
        raise APIError(400, f"chat_template_kwargs may not set {clashing}: they are arguments of the template call, "
                            "not template variables (a request cannot bring its own chat template)",
                       param="chat_template_kwargs", code="unsupported_parameter")
    return dict(kwargs or {})


class _Lenient(BaseModel):
    """Strict types for what torpor reads; other fields accepted and ignored (vLLM's messages)."""

    model_config = ConfigDict(extra="allow", strict=True)
    ignore_extra_fields: ClassVar[bool] = True


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class FunctionCallParam(_Lenient):
    name: str
    arguments: str


class ToolCallParam(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(_Lenient):
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None

    def text(self, index: int) -> str:
        """The content as one string (text parts joined); 400 naming the field for what is missing or not
        text. Only an assistant message with tool calls may leave its content out (OpenAI's rule)."""
        if self.content is None:
            if self.role == "assistant" and self.tool_calls:
                return ""
            need = "an assistant message needs 'content' unless it has 'tool_calls'" if self.role == "assistant" \
                else f"a {self.role!r} message needs 'content'"
            raise APIError(400, f"messages.{index}.content: {need}", param=f"messages.{index}.content")
        if isinstance(self.content, str):
            return self.content
        for number, part in enumerate(self.content):
            param = f"messages.{index}.content.{number}"
            if part.type != "text":
                raise APIError(400, f"content part of type {part.type!r} is not supported (text only)",
                               param=f"messages.{index}.content")
            if part.text is None:
                raise APIError(400, f"{param}: a content part of type 'text' needs a string 'text', got null",
                               param=f"{param}.text")
        return "".join(part.text for part in self.content)

    def for_template(self, index: int) -> dict[str, Any]:
        """The message as the chat template sees it (vLLM's conversation entry)."""
        entry: dict[str, Any] = {"role": self.role, "content": self.text(index)}
        if self.role == "assistant":
            if self.tool_calls:
                entry["tool_calls"] = [self._call(index, number, call) for number, call in enumerate(self.tool_calls)]
            reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
            if reasoning is not None:
                entry["reasoning"] = entry["reasoning_content"] = reasoning
        elif self.role == "tool" and self.tool_call_id is not None:
            entry["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            entry["name"] = self.name
        return entry

    @staticmethod
    def _call(index: int, number: int, call: ToolCallParam) -> dict[str, Any]:
        arguments: Any = {}
        if call.function.arguments:
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError as exc:
                param = f"messages.{index}.tool_calls.{number}.function.arguments"
                raise APIError(400, f"{param} must be JSON text: {exc}", param=param) from None
        return {"id": call.id, "type": call.type, "function": {"name": call.function.name, "arguments": arguments}}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # OpenAI's structured-outputs flag: accepted, not rendered (vLLM's template dict)


class ToolParam(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        function = self.function
        return {"type": "function", "function": {"name": function.name, "description": function.description,
                                                 "parameters": function.parameters}}


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra, e.g. {"enable_thinking": false}
    # vLLM's extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    echo: bool = False  # the reply starts with the last message's content when that is the assistant's

    def conversation(self) -> list[dict[str, Any]]:
        """The messages for the chat template (each checked: a 400 names what is missing)."""
        return [message.for_template(i) for i, message in enumerate(self.messages)]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return None if self.tools is None else [tool.for_template() for tool in self.tools]

    def resolve_tool_choice(self, auto_enabled: bool) -> bool:
        """Check tools and tool_choice as vLLM does; True when the output is to be read for tool calls."""
        if self.tools == []:
            raise APIError(400, "`tools` must not be an empty array. Either provide at least one tool or omit the "
                                "field entirely.", param="tools")
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        if choice == "none":
            return False
        if not self.tools:
            raise APIError(400, "When using `tool_choice`, `tools` must be set.", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise APIError(400, "The tool specified in `tool_choice` does not match any of the specified `tools`",
                           param="tool_choice")
        if choice != "auto":
            shown = choice if isinstance(choice, str) else choice.model_dump()
            raise APIError(400, f"tool_choice={shown!r} is not supported by torpor: vLLM forces the call with guided "
                                "decoding, which torpor does not have; use \"auto\" or \"none\"", param="tool_choice",
                           code="unsupported_parameter")
        if not auto_enabled:
            raise APIError(400, AUTO_TOOLS_OFF, param="tool_choice")
        return True

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise APIError(400, "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def num_prompt_logprobs(self) -> int | None:
        """Prompt logprobs to compute: those asked for, or with `echo` the `top_logprobs` (vLLM's rule)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return (self.top_logprobs or 0) if self.echo else None

    def echoed(self, conversation: list[dict[str, Any]]) -> str:
        """With `echo`, the text the reply starts with: the last message's content if it is the
        assistant's (vLLM's rule), else nothing."""
        if not self.echo or conversation[-1]["role"] != "assistant":
            return ""
        return conversation[-1]["content"] or ""

    def max_tokens_field(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"
