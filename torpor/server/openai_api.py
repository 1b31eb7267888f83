"""The OpenAI-compatible inference endpoints: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from torpor.engine.generation_config import generation_defaults
from torpor.engine.outputs import RequestOutput
from torpor.engine.sampling_params import SamplingParams
from torpor.server.auth import require_api_key
from torpor.server.chat_protocol import ChatCompletionRequest, template_kwargs
from torpor.server.errors import APIError, engine_error, json_text
from torpor.server.generation import Submitted, outputs, results, submit
from torpor.server.prompts import Prompts, prompts_of
from torpor.server.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    CompletionRequest,
    GenerationRequest,
    check_logprobs,
    resolve_max_tokens,
)
from torpor.server.responses import ChatFormat, CompletionFormat, ResponseFormat
from torpor.server.tool_calls import TOOL_PARSERS

if TYPE_CHECKING:
    from torpor.server.state import ServerState

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    server: ServerState = request.app.state.server
    return {"object": "list", "data": [{
        "id": server.config.model_name, "object": "model", "created": server.started, "owned_by": "torpor",
        "max_model_len": server.engine.config.max_model_len}]}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    server: ServerState = request.app.state.server
    _check_request(server, body)
    body, default_max_tokens = _with_generation_defaults(server, body)
    check_logprobs(body.logprobs, "logprobs")
    items = body.prompt_list()
    prompts = prompts_of(request)
    prompts.check_count(len(items), "prompt")
    token_ids = await _completion_prompts(prompts, items)
    echo_only = bool(body.echo) and body.max_tokens == 0  # vLLM: the prompt alone (one token is generated)
    max_tokens = _max_tokens(server, 1 if echo_only else body.max_tokens,
                             default_max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS, max(map(len, token_ids)))
    num_prompt_logprobs = body.num_prompt_logprobs()
    params = body.sampling_params(max_tokens, body.logprobs, num_prompt_logprobs)
    tokenizer = server.engine.tokenizer
    echo_texts = None
    if body.echo:  # vLLM echoes no text with return_token_ids (the ids say it)
        echo_texts = ["" if body.return_token_ids else item if isinstance(item, str)
                      else tokenizer.decode(ids, skip_special_tokens=False)
                      for item, ids in zip(items, token_ids, strict=True)]
    fmt = CompletionFormat(tokenizer, server.config.model_name, f"cmpl-{uuid.uuid4().hex}", body.logprobs,
                           **_format_options(body, num_prompt_logprobs), echo_texts=echo_texts, echo_only=echo_only)
    return await _generate(request, server, "completions", fmt, token_ids, params, body, "prompt")


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    server: ServerState = request.app.state.server
    _check_request(server, body)
    body, default_max_tokens = _with_generation_defaults(server, body)
    check_logprobs(body.top_logprobs, "top_logprobs")
    num_logprobs = body.num_logprobs()
    read_tools = body.resolve_tool_choice(server.config.enable_auto_tool_choice)
    conversation = body.conversation()
    token_ids = await prompts_of(request).render(
        conversation, body.tool_dicts(), add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message, add_special_tokens=body.add_special_tokens,
        template_kwargs=template_kwargs(body.chat_template_kwargs))
    requested, param = body.max_tokens_field()
    max_tokens = _max_tokens(server, requested, default_max_tokens, len(token_ids), param, "messages")
    num_prompt_logprobs = None if body.stream else body.num_prompt_logprobs()  # a stream carries none
    # vLLM's tool parsers read the special tokens too (a model's <tool_call> may be one)
    overrides = {"skip_special_tokens": False} if read_tools else {}
    params = body.sampling_params(max_tokens, num_logprobs, num_prompt_logprobs, **overrides)
    parser = TOOL_PARSERS[server.config.tool_call_parser]() if read_tools else None
    fmt = ChatFormat(server.engine.tokenizer, server.config.model_name, f"chatcmpl-{uuid.uuid4().hex}", num_logprobs,
                     **_format_options(body, num_prompt_logprobs), prompt_token_ids=token_ids, tool_parser=parser,
                     echo=body.echoed(conversation))
    return await _generate(request, server, "chat", fmt, [token_ids], params, body, "messages")


def _check_request(server: ServerState, body: GenerationRequest) -> None:
    if body.model is not None and body.model != server.config.model_name:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                            f"{server.config.model_name!r}", param="model", code="model_not_found")
    body.check_known_fields()
    body.check_supported()


def _format_options(body: GenerationRequest, num_prompt_logprobs: int | None) -> dict:
    return {"num_prompt_logprobs": num_prompt_logprobs, "tokens_as_ids": bool(body.return_tokens_as_token_ids),
            "return_token_ids": bool(body.return_token_ids), "continuous_usage": body.continuous_usage}


def _with_generation_defaults(server: ServerState, body: GenerationRequest) -> tuple[GenerationRequest, int | None]:
    """The request with the model's generation_config.json defaults (`--generation-config`) in the
    sampling fields it left out, as vLLM does; and the default max_tokens (None: none set)."""
    config = server.engine.config
    defaults = generation_defaults(config.generation_config, config.model)
    omitted = {field: value for field, value in defaults.items()
               if field in type(body).model_fields and field != "max_tokens" and field not in body.model_fields_set}
    return (body.model_copy(update=omitted) if omitted else body), defaults.get("max_tokens")


def _max_tokens(server: ServerState, requested: int | None, default: int | None, num_prompt_tokens: int,
                param: str = "max_tokens", prompt_param: str = "prompt") -> int:
    max_model_len = server.engine.config.max_model_len
    cap = server.config.max_tokens_cap or max_model_len
    return resolve_max_tokens(requested, default, num_prompt_tokens, max_model_len, cap, param, prompt_param)


async def _completion_prompts(prompts: Prompts, items: list[str | list[int]]) -> list[list[int]]:
    """The token ids of each prompt (the texts in one tokenizer call, off the event loop when long)."""
    if any(item == "" or item == [] for item in items):
        raise APIError(400, "the prompt is empty", param="prompt")
    texts = [item for item in items if isinstance(item, str)]
    encoded = iter(await prompts.encode(texts, True, "prompt") if texts else ())
    return [next(encoded) if isinstance(item, str) else list(item) for item in items]


async def _generate(request: Request, server: ServerState, endpoint: str, fmt: ResponseFormat,
                    prompts: list[list[int]], params: SamplingParams, body: GenerationRequest, prompt_param: str):
    """One engine request per prompt (a batch of prompts in /v1/completions), each with `params.n` samples."""
    start = time.perf_counter()
    ids = [fmt.request_id] if len(prompts) == 1 else [f"{fmt.request_id}-{i}" for i in range(len(prompts))]
    submitted = await submit(request, server, prompts, params, ids, bool(body.stream), prompt_param)

    def done(output: RequestOutput) -> None:
        server.metrics.observe_request(endpoint, time.perf_counter() - start, len(output.prompt_token_ids),
                                       sum(len(c.token_ids) for c in output.outputs))

    if body.stream:
        events = _stream_events(submitted, fmt, params.n, body.include_usage, done)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    finals = await results(request, submitted)
    for output in finals:
        done(output)
    return fmt.response(finals)


async def _stream_events(submitted: Submitted, fmt: ResponseFormat, n: int, include_usage: bool,
                         done: Callable[[RequestOutput], None]) -> AsyncIterator[str]:
    """Server-sent events: the opening chunks (chat), one chunk per step for each choice that gained text or
    tokens (choice index = prompt index * n + sample index; the engine's deltas, stop strings already
    applied), each choice's final chunk with its finish reason, the usage (if asked for), then `[DONE]`. An
    engine error, or the asleep timeout, ends the stream with an error event."""
    finals: list[RequestOutput] = []
    try:
        for chunk in fmt.opening_chunks(len(submitted.streams) * n):
            yield _sse(chunk)
        async with contextlib.aclosing(outputs(submitted)) as stream:
            async for i, output in stream:
                for completion in output.outputs:
                    chunk = fmt.step_chunk(output, completion, i * n + completion.index)
                    if chunk is not None:
                        yield _sse(chunk)
                if output.finished:
                    finals.append(output)
                    done(output)
        if include_usage:
            yield _sse(fmt.usage_chunk(finals))
    except Exception as exc:
        yield _sse(engine_error(exc).body())
    finally:
        submitted.abort()
    yield "data: [DONE]\n\n"


def _sse(data: dict) -> str:
    return f"data: {json_text(data)}\n\n"  # strict JSON, as every response
