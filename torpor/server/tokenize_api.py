"""vLLM's `/tokenize` and `/detokenize` (same bodies, same answers), behind the API key.

POST /tokenize {"prompt": text, "add_special_tokens": true} or {"messages": [...], "add_generation_prompt":
true, "continue_final_message": false, "add_special_tokens": false, "chat_template_kwargs": {...}, "tools":
[...]}, either with "return_token_strs" -> {"count", "max_model_len", "tokens", "token_strs"}.
POST /detokenize {"tokens": [ids]} -> {"prompt": text}.
Types are strict (`add_special_tokens: "yes"`, `tokens: [true]` are 400s naming the field); the work runs
off the event loop and a text too long for the context is refused before it is tokenized (prompts.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictInt, Tag

from torpor.server.auth import require_api_key
from torpor.server.chat_protocol import ChatMessage, ToolParam, template_kwargs
from torpor.server.errors import APIError
from torpor.server.prompts import Prompts, prompts_of
from torpor.server.protocol import check_unicode

if TYPE_CHECKING:
    from torpor.server.state import ServerState

router = APIRouter(dependencies=[Depends(require_api_key)])


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None


class TokenizeCompletionRequest(_Request):
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)  # checked and rendered as /v1/chat/completions does
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolParam] | None = None


def _form(body: Any) -> str:
    return "Chat" if isinstance(body, dict) and "messages" in body else "Completion"


# One form by its fields ("messages" or not), so a 400 names the field of that form, not of both.
TokenizeRequest = Annotated[Annotated[TokenizeCompletionRequest, Tag("Completion")]
                            | Annotated[TokenizeChatRequest, Tag("Chat")], Discriminator(_form)]


class DetokenizeRequest(_Request):
    tokens: list[StrictInt]  # true is not token 1


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    server: ServerState = request.app.state.server
    _check_model(server, body.model)
    check_unicode(body)
    tokenizer, prompts = server.engine.tokenizer, prompts_of(request)
    if isinstance(body, TokenizeChatRequest):
        tokens = await _render(prompts, body)
    else:
        (tokens,) = await prompts.encode([body.prompt], body.add_special_tokens, "prompt")
    return {"count": len(tokens), "max_model_len": server.engine.config.max_model_len, "tokens": tokens,
            "token_strs": tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    server: ServerState = request.app.state.server
    _check_model(server, body.model)
    vocab_size = server.engine.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"tokens must be ids in [0, {vocab_size}) (the model's vocabulary), got {bad[:5]}",
                       param="tokens")
    return {"prompt": server.engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}


async def _render(prompts: Prompts, body: TokenizeChatRequest) -> list[int]:
    if body.chat_template is not None:  # templates are code: only the server's own run
        raise APIError(400, "chat_template in a request is not accepted; the server uses its model's template "
                            "(or --chat-template)", param="chat_template", code="unsupported_parameter")
    return await prompts.render(
        [message.for_template(i) for i, message in enumerate(body.messages)],
        None if body.tools is None else [tool.for_template() for tool in body.tools],
        add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message,
        add_special_tokens=body.add_special_tokens, template_kwargs=template_kwargs(body.chat_template_kwargs))


def _check_model(server: ServerState, model: str | None) -> None:
    if model is not None and model != server.config.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {server.config.model_name!r}",
                       param="model", code="model_not_found")
