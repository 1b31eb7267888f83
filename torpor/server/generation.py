"""Engine requests for the HTTP generation routes (OpenAI's and SGLang's).

`submit` refuses at once what the engine would refuse (asleep or not), waits for a sleeping (or paused) engine
(or answers 503 after the asleep timeout), then queues one engine request per prompt. `results` waits for
their final outputs, `outputs` streams them; either way a client that goes away aborts its requests,
and a sleep that outlasts the timeout while they are queued ends them with the same 503.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request

from torpor.engine.llm_engine import RequestError
from torpor.engine.outputs import RequestOutput
from torpor.engine.sampling_params import SamplingParams
from torpor.server.async_engine import RequestStream
from torpor.server.errors import APIError, engine_error

if TYPE_CHECKING:
    from torpor.server.state import ServerState

ASLEEP_TIMEOUT_HEADER = "x-asleep-timeout"
ENGINE_STOPPED = "the engine has stopped; restart the server"


@dataclass
class Submitted:
    """The queued engine requests of one HTTP request (prompt index order)."""

    server: ServerState
    streams: list[RequestStream]
    timeout: float | None  # the asleep timeout that also bounds a wait behind a later sleep

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()

    async def expire(self) -> None:
        """Once the engine has not served for `timeout` seconds in a row (a sleep came while these requests
        were queued), end those still waiting with the 503 of `wait_if_asleep` (outputs delivered before,
        e.g. by a sleep's drain, are read first)."""
        await self.server.engine.not_served_for(self.timeout)
        error = not_served_error(self.server, self.timeout)
        for stream in self.streams:
            stream.fail(error)


async def submit(request: Request, server: ServerState, prompts: Sequence[list[int]],
                 params: SamplingParams | Sequence[SamplingParams], request_ids: Sequence[str], stream: bool,
                 prompt_param: str) -> Submitted:
    """Queue one engine request per prompt (`params` for all, or one per prompt). A request the engine
    refuses is a 400 naming the field (`prompt_param` for the prompt itself); a request id in use a 400
    naming `rid`."""
    each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    try:  # before waiting: a request the engine refuses is a 400 at once, asleep or not
        for token_ids, sampling in zip(prompts, each, strict=True):
            server.engine.check_request(token_ids, sampling)
    except RequestError as exc:
        raise APIError(400, str(exc), param=prompt_param if exc.field == "prompt" else exc.field,
                       code=exc.code) from None
    timeout = await wait_if_asleep(request, server)
    submitted = Submitted(server, [], timeout)
    try:
        # one command: every prompt of the body enters the same engine step
        submitted.streams.extend(await server.engine.add_requests(list(zip(request_ids, prompts, each, strict=True)),
                                                                  stream=stream))
    except BaseException as exc:
        submitted.abort()
        if isinstance(exc, ValueError) and "already in use" in str(exc):
            raise APIError(400, str(exc), param="rid", code="duplicate_request_id") from None
        if isinstance(exc, Exception):
            raise engine_error(exc) from None
        raise
    return submitted


async def results(request: Request, submitted: Submitted) -> list[RequestOutput]:
    """The final output of each request; a disconnect or an engine error aborts them all (a 499 nobody
    reads, or the error)."""
    tasks = [asyncio.ensure_future(stream.result()) for stream in submitted.streams]
    watchers = [asyncio.ensure_future(_disconnected(request))]
    if submitted.timeout is not None:
        watchers.append(asyncio.ensure_future(submitted.expire()))
    try:
        pending = set(tasks)
        while pending:
            done, _ = await asyncio.wait({*pending, watchers[0]}, return_when=asyncio.FIRST_COMPLETED)
            pending -= done
            if watchers[0] in done:
                raise APIError(499, "the client disconnected", code="client_disconnected")
            failed = next((task for task in done if task.exception() is not None), None)
            if failed is not None:
                raise engine_error(failed.exception()) from None
        return [task.result() for task in tasks]
    finally:
        _cancel(tasks + watchers)
        submitted.abort()


async def outputs(submitted: Submitted) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) as the engine produces them, across all the requests, until each has
    finished; an engine error (or the asleep timeout) is raised. Closing it early aborts the requests."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await merged.put((index, output))
        except Exception as exc:
            await merged.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(submitted.streams)]
    if submitted.timeout is not None:
        tasks.append(asyncio.ensure_future(submitted.expire()))
    num_open = len(submitted.streams)
    try:
        while num_open:
            index, output = await merged.get()
            if isinstance(output, BaseException):
                raise output
            num_open -= output.finished
            yield index, output
    finally:
        _cancel(tasks)
        submitted.abort()


def _cancel(tasks: list[asyncio.Future]) -> None:
    """Cancel what still runs; retrieve what ended with an error nobody else read (else asyncio logs
    'exception was never retrieved' when the task is collected)."""
    for task in tasks:
        if not task.done():
            task.cancel()
        elif not task.cancelled():
            task.exception()


async def wait_if_asleep(request: Request, server: ServerState) -> float | None:
    """With an asleep timeout (the header's, else the server's), a request the engine does not serve
    within it gets 503; without one it queues until the engine serves again. Returns the timeout (it
    also bounds the wait of a request queued before a sleep: `Submitted.expire`)."""
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
        raise not_served_error(server, timeout)
    return timeout


def not_served_error(server: ServerState, timeout: float) -> APIError:
    if not server.engine.alive:
        return APIError(503, ENGINE_STOPPED, code="engine_dead")
    state = server.engine.state
    code = "weights_discarded" if not state.is_sleeping and not state.weights_valid else \
        "generation_paused" if not state.is_sleeping and state.paused is not None else "engine_asleep"
    return APIError(503, f"the engine did not serve within {timeout:g} s: {state.not_serving_reason()}", code=code)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
