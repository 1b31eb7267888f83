"""The OpenAI-compatible inference endpoints: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from torpor.engine.outputs import RequestOutput
from torpor.engine.sampling_params import SamplingParams
from torpor.server.async_engine import RequestStream
from torpor.server.auth import require_api_key
from torpor.server.errors import APIError, engine_error
from torpor.server.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    check_logprobs,
    check_prompt_length,
    resolve_max_tokens,
)
from torpor.server.responses import ChatFormat, CompletionFormat, ResponseFormat, StreamText

if TYPE_CHECKING:
    from torpor.server.app import ServerState

ASLEEP_TIMEOUT_HEADER = "x-asleep-timeout"
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
    token_ids = body.prompt_token_ids(server.engine.tokenizer, server.engine.vocab_size)
    check_prompt_length(len(token_ids), server.engine.config.max_model_len, "prompt")
    check_logprobs(body.logprobs, "logprobs")
    max_tokens = _max_tokens(server, body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, len(token_ids))
    params = body.sampling_params(max_tokens, body.logprobs)
    fmt = CompletionFormat(server.engine.tokenizer, server.config.model_name, f"cmpl-{uuid.uuid4().hex}",
                           body.logprobs)
    fmt.return_token_ids = bool(body.return_token_ids)
    return await _generate(request, server, "completions", fmt, token_ids, params, body)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    server: ServerState = request.app.state.server
    _check_request(server, body)
    token_ids = body.prompt_token_ids(server.engine.tokenizer)
    check_prompt_length(len(token_ids), server.engine.config.max_model_len, "messages")
    check_logprobs(body.top_logprobs, "top_logprobs")
    num_logprobs = body.num_logprobs()
    requested, param = ((body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens
                        is not None else (body.max_tokens, "max_tokens"))
    max_tokens = _max_tokens(server, requested, None, len(token_ids), param)
    params = body.sampling_params(max_tokens, num_logprobs)
    fmt = ChatFormat(server.engine.tokenizer, server.config.model_name, f"chatcmpl-{uuid.uuid4().hex}",
                     num_logprobs)
    return await _generate(request, server, "chat", fmt, token_ids, params, body)


def _check_request(server: ServerState, body: GenerationRequest) -> None:
    if body.model is not None and body.model != server.config.model_name:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                            f"{server.config.model_name!r}", param="model", code="model_not_found")
    body.check_supported()


def _max_tokens(server: ServerState, requested: int | None, default: int | None, num_prompt_tokens: int,
                param: str = "max_tokens") -> int:
    max_model_len = server.engine.config.max_model_len
    cap = server.config.max_tokens_cap or max_model_len
    return resolve_max_tokens(requested, default, num_prompt_tokens, max_model_len, cap, param)


async def _generate(request: Request, server: ServerState, endpoint: str, fmt: ResponseFormat, token_ids: list[int],
                    params: SamplingParams, body: GenerationRequest):
    start = time.perf_counter()
    await _wait_if_asleep(request, server)
    try:
        stream = await server.engine.add_request(fmt.request_id, token_ids, params, stream=bool(body.stream))
    except Exception as exc:
        raise engine_error(exc) from None

    def done(output: RequestOutput) -> None:
        server.metrics.observe_request(endpoint, time.perf_counter() - start, len(token_ids),
                                       len(output.outputs[0].token_ids))

    if body.stream:
        events = _stream_events(stream, fmt, params, len(token_ids), body.include_usage, done)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        output = await _unless_disconnected(request, stream.result())
    except Exception as exc:
        raise engine_error(exc) from None
    finally:
        stream.abort()
    done(output)
    return fmt.response(output)


async def _wait_if_asleep(request: Request, server: ServerState) -> None:
    """With an asleep timeout (the header's, else the server's), a request the engine does not serve
    within it gets 503; without one it queues until the engine serves again."""
    if not server.engine.alive:
        raise APIError(503, "the engine has stopped; restart the server", code="engine_dead")
    header = request.headers.get(ASLEEP_TIMEOUT_HEADER)
    timeout = server.config.asleep_timeout
    if header is not None:
        try:
            timeout = float(header)
            if not timeout >= 0 or timeout == float("inf"):
                raise ValueError
        except ValueError:
            raise APIError(400, f"the {ASLEEP_TIMEOUT_HEADER} header must be a number of seconds >= 0, got "
                                f"{header!r}", param=ASLEEP_TIMEOUT_HEADER) from None
    if timeout is None or server.engine.serving:
        return
    if not await server.engine.wait_until_serving(timeout):
        raise APIError(503, f"the engine is asleep (or its weights await reload_weights) and did not serve "
                            f"within {timeout:g} s; retry after a wake_up", code="engine_asleep")


async def _unless_disconnected(request: Request, awaitable):
    """The result of `awaitable`, or cancel it when the client disconnects first (its request is
    then aborted by the caller's `finally`)."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not work.done():
        work.cancel()
        raise APIError(499, "the client disconnected", code="client_disconnected")  # nobody reads it
    return work.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream_events(stream: RequestStream, fmt: ResponseFormat, params: SamplingParams, num_prompt_tokens: int,
                         include_usage: bool, done) -> AsyncIterator[str]:
    """Server-sent events: an opening chunk (chat), one chunk per step's tokens, the final chunk with
    the finish reason, the usage (if asked for), then `[DONE]`. An engine error ends the stream with
    an error event."""
    text = StreamText(fmt.tokenizer, params.stop)
    num_received = 0
    try:
        opening = fmt.opening_chunk()
        if opening is not None:
            yield _sse(opening)
        async for item in stream:
            if isinstance(item, RequestOutput):
                completion = item.outputs[0]
                token_ids = completion.token_ids[num_received:]
                logprobs = None if completion.logprobs is None else completion.logprobs[num_received:]
                yield _sse(fmt.chunk(text.finish(completion.text), token_ids, logprobs, completion.finish_reason))
                if include_usage:
                    yield _sse(fmt.usage_chunk(num_prompt_tokens, len(completion.token_ids)))
                done(item)
            else:
                num_received += len(item.token_ids)
                yield _sse(fmt.chunk(text.add(item.token_ids), item.token_ids, item.logprobs, None))
    except Exception as exc:
        yield _sse(engine_error(exc).body())
    finally:
        stream.abort()
    yield "data: [DONE]\n\n"


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
