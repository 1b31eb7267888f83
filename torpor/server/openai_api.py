"""The OpenAI-compatible inference endpoints: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from torpor.engine.generation_config import generation_defaults
from torpor.engine.llm_engine import RequestError
from torpor.engine.outputs import RequestOutput
from torpor.engine.sampling_params import SamplingParams
from torpor.server.async_engine import RequestStream
from torpor.server.auth import require_api_key
from torpor.server.errors import APIError, engine_error, json_text
from torpor.server.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    check_logprobs,
    resolve_max_tokens,
)
from torpor.server.responses import ChatFormat, CompletionFormat, ResponseFormat

if TYPE_CHECKING:
    from torpor.server.state import ServerState

ASLEEP_TIMEOUT_HEADER = "x-asleep-timeout"
ENGINE_STOPPED = "the engine has stopped; restart the server"
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
    prompts = body.prompts_token_ids(server.engine.tokenizer)
    check_logprobs(body.logprobs, "logprobs")
    max_tokens = _max_tokens(server, body.max_tokens, default_max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS,
                             max(map(len, prompts)))
    params = body.sampling_params(max_tokens, body.logprobs)
    fmt = CompletionFormat(server.engine.tokenizer, server.config.model_name, f"cmpl-{uuid.uuid4().hex}",
                           body.logprobs)
    fmt.return_token_ids = bool(body.return_token_ids)
    return await _generate(request, server, "completions", fmt, prompts, params, body)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    server: ServerState = request.app.state.server
    _check_request(server, body)
    body, default_max_tokens = _with_generation_defaults(server, body)
    token_ids = body.prompt_token_ids(server.engine.tokenizer)
    check_logprobs(body.top_logprobs, "top_logprobs")
    num_logprobs = body.num_logprobs()
    requested, param = ((body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens
                        is not None else (body.max_tokens, "max_tokens"))
    max_tokens = _max_tokens(server, requested, default_max_tokens, len(token_ids), param)
    params = body.sampling_params(max_tokens, num_logprobs)
    fmt = ChatFormat(server.engine.tokenizer, server.config.model_name, f"chatcmpl-{uuid.uuid4().hex}",
                     num_logprobs)
    return await _generate(request, server, "chat", fmt, [token_ids], params, body)



def _check_request(server: ServerState, body: GenerationRequest) -> None:
    if body.model is not None and body.model != server.config.model_name:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                            f"{server.config.model_name!r}", param="model", code="model_not_found")
    body.check_known_fields()
    body.check_supported()


def _with_generation_defaults(server: ServerState, body: GenerationRequest) -> tuple[GenerationRequest, int | None]:
    """The request with the model's generation_config.json defaults (`--generation-config`) in the
    sampling fields it left out, as vLLM does; and the default max_tokens (None: none set)."""
    config = server.engine.config
    defaults = generation_defaults(config.generation_config, config.model)
    omitted = {field: value for field, value in defaults.items()
               if field in type(body).model_fields and field != "max_tokens" and field not in body.model_fields_set}
    return (body.model_copy(update=omitted) if omitted else body), defaults.get("max_tokens")


def _max_tokens(server: ServerState, requested: int | None, default: int | None, num_prompt_tokens: int,
                param: str = "max_tokens") -> int:
    max_model_len = server.engine.config.max_model_len
    cap = server.config.max_tokens_cap or max_model_len
    return resolve_max_tokens(requested, default, num_prompt_tokens, max_model_len, cap, param)


async def _generate(request: Request, server: ServerState, endpoint: str, fmt: ResponseFormat,
                    prompts: list[list[int]], params: SamplingParams, body: GenerationRequest):
    """One engine request per prompt (a batch of prompts in /v1/completions), each with `params.n` samples."""
    start = time.perf_counter()
    try:  # before waiting: a request the engine refuses is a 400 at once, asleep or not
        for token_ids in prompts:
            server.engine.check_request(token_ids, params)
    except RequestError as exc:
        param = ("prompt" if endpoint == "completions" else "messages") if exc.field == "prompt" else exc.field
        raise APIError(400, str(exc), param=param, code=exc.code) from None
    timeout = await _wait_if_asleep(request, server)
    streams: list[RequestStream] = []
    try:
        for i, token_ids in enumerate(prompts):
            request_id = fmt.request_id if len(prompts) == 1 else f"{fmt.request_id}-{i}"
            streams.append(await server.engine.add_request(request_id, token_ids, params, stream=bool(body.stream)))
    except Exception as exc:
        for stream in streams:
            stream.abort()
        raise engine_error(exc) from None

    def done(output: RequestOutput) -> None:
        server.metrics.observe_request(endpoint, time.perf_counter() - start, len(output.prompt_token_ids),
                                       sum(len(c.token_ids) for c in output.outputs))

    def expire() -> Awaitable[None]:
        return _expire_if_not_served(server, streams, timeout)

    if body.stream:
        events = _stream_events(streams, fmt, params.n, prompts, body.include_usage, done,
                                None if timeout is None else expire)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    expiry = None if timeout is None else asyncio.ensure_future(expire())
    try:
        outputs = await _unless_disconnected(request, asyncio.gather(*(stream.result() for stream in streams)))
    except Exception as exc:
        raise engine_error(exc) from None
    finally:
        if expiry is not None:
            expiry.cancel()
        for stream in streams:
            stream.abort()
    for output in outputs:
        done(output)
    return fmt.response(list(outputs))


async def _wait_if_asleep(request: Request, server: ServerState) -> float | None:
    """With an asleep timeout (the header's, else the server's), a request the engine does not serve
    within it gets 503; without one it queues until the engine serves again. Returns the timeout (it
    also bounds the wait of a request queued before a sleep: `_expire_if_not_served`)."""
    if not server.engine.alive:
        raise APIError(503, ENGINE_STOPPED, code="engine_dead")
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
    if timeout is not None and not server.engine.serving and not await server.engine.wait_until_serving(timeout):
        raise _not_served_error(server, timeout)
    return timeout


async def _expire_if_not_served(server: ServerState, streams: list[RequestStream], timeout: float) -> None:
    """Once the engine has not served for `timeout` seconds in a row (a sleep came while these requests
    were queued), end those still waiting with the 503 of `_wait_if_asleep`; outputs already delivered
    (a sleep's drain) are read first."""
    await server.engine.not_served_for(timeout)
    error = _not_served_error(server, timeout)
    for stream in streams:
        stream.fail(error)


def _not_served_error(server: ServerState, timeout: float) -> APIError:
    if not server.engine.alive:
        return APIError(503, ENGINE_STOPPED, code="engine_dead")
    state = server.engine.state
    code = "weights_discarded" if not state.is_sleeping and not state.weights_valid else "engine_asleep"
    return APIError(503, f"the engine did not serve within {timeout:g} s: {state.not_serving_reason()}", code=code)


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


async def _stream_events(streams: list[RequestStream], fmt: ResponseFormat, n: int, prompts: list[list[int]],
                         include_usage: bool, done, expire: Callable[[], Awaitable[None]] | None = None
                         ) -> AsyncIterator[str]:
    """Server-sent events: an opening chunk per choice (chat), one chunk per step for each choice that gained
    text or tokens (choice index = prompt index * n + sample index; the engine's deltas, stop strings already
    applied), each choice's final chunk with its finish reason, the usage (if asked for), then `[DONE]`. An
    engine error, or `expire` (see `_expire_if_not_served`), ends the stream with an error event."""
    merged: asyncio.Queue = asyncio.Queue()  # (prompt index, output or error) from every prompt's stream

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await merged.put((i, output))
        except Exception as exc:
            await merged.put((i, exc))

    pumps = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    if expire is not None:
        pumps.append(asyncio.create_task(expire()))
    ended: set[int] = set()  # choices whose final chunk went out
    num_output_tokens, num_open = 0, len(streams)
    try:
        for index in range(len(streams) * n):
            opening = fmt.opening_chunk(index)
            if opening is not None:
                yield _sse(opening)
        while num_open:
            i, output = await merged.get()
            if isinstance(output, BaseException):
                raise output
            for completion in output.outputs:
                index = i * n + completion.index
                if index in ended or not (completion.delta_text or completion.delta_token_ids
                                          or completion.finish_reason is not None):
                    continue
                if completion.finish_reason is not None:
                    ended.add(index)
                yield _sse(fmt.chunk(completion.delta_text, completion.delta_token_ids, completion.delta_logprobs,
                                     completion.finish_reason, index, completion.stop_reason,
                                     completion.delta_routed_experts))
            if output.finished:
                num_open -= 1
                num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                done(output)
        if include_usage:
            yield _sse(fmt.usage_chunk(sum(map(len, prompts)), num_output_tokens))
    except Exception as exc:
        yield _sse(engine_error(exc).body())
    finally:
        for task in pumps:
            task.cancel()
        for stream in streams:
            stream.abort()
    yield "data: [DONE]\n\n"


def _sse(data: dict) -> str:
    return f"data: {json_text(data)}\n\n"  # strict JSON, as every response
