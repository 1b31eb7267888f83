"""`AsyncEngine`: one `LLMEngine` driven by one thread, awaited from asyncio.

The engine thread is the only one that touches the engine. It runs every queued command (add or
abort a request, sleep, wake, reload, read memory) between steps, and steps while there is work;
otherwise it blocks on its inbox (it never spins). The engine's outputs (finished ones and, for
streaming requests, each step's text and token deltas, built by the engine) go back to the event loop
with `call_soon_threadsafe`. The engine's state (`LLMEngine.state()`) is published after every
command. A step that raises fails the requests it was serving (they get the error) and the thread
goes on; a sleep or wake resolves only once it is complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from torpor.engine.llm_engine import EngineState, LLMEngine
from torpor.engine.outputs import RequestOutput
from torpor.engine.sampling_params import SamplingParams

logger = logging.getLogger("torpor.server")


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; nothing more can be served."""


class EngineStepError(RuntimeError):
    """An engine step raised; the requests it was serving were aborted (the engine thread goes on)."""


_Command = tuple[Callable[..., Any], tuple, "asyncio.Future | None"]


class AsyncEngine:
    """Serves one `LLMEngine`; once started, only the engine thread touches it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.vocab_size
        self.weight_version: str = "default"
        self._inbox: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue] = {}  # request id -> its stream's queue; engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._serving_event: asyncio.Event | None = None
        self._idle_event: asyncio.Event | None = None  # set while the engine does not serve
        self.dead: BaseException | None = None
        self.state: EngineState = engine.state()  # written by the engine thread after every command

    @property
    def serving(self) -> bool:
        return self.state.serving

    @property
    def sleeping(self) -> bool:
        return self.state.is_sleeping

    # ---- life cycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will await the engine."""
        if self._thread is not None:
            raise RuntimeError("the AsyncEngine is already started")
        if self.engine.served_by is not None:
            raise RuntimeError(f"the engine is already served by {self.engine.served_by}")
        self.engine.served_by = "a running AsyncEngine (the server)"
        self._loop = asyncio.get_running_loop()
        self._serving_event, self._idle_event = asyncio.Event(), asyncio.Event()
        (self._serving_event if self.serving else self._idle_event).set()
        self._thread = threading.Thread(target=self._run, name="torpor-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is unfinished and end the engine thread (after its current step)."""
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(None)
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    # ---- requests --------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          stream: bool = False) -> RequestStream:
        """Queue a request; raises ValueError if the engine rejects it. Iterate the returned stream for its
        `RequestOutput`s: with `stream` one per step that gained tokens (their `delta_*` fields), the last
        one finished."""
        request_stream = RequestStream(self, request_id)
        try:
            await self.call(self._add, request_id, prompt_token_ids, params, stream, request_stream.queue)
        except asyncio.CancelledError:  # the add still runs: abort after it (the inbox is FIFO)
            self._submit(self._abort, request_id)
            raise
        return request_stream

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise the engine's `RequestError` if it would refuse this request (asleep or not; reads only
        the tokenizer and the configuration, so any thread may call it)."""
        self.engine.make_sequence(prompt_token_ids, params, "check")

    async def wait_until_serving(self, timeout: float | None) -> bool:
        """True once the engine serves (awake, weights valid); False after `timeout` seconds."""
        try:
            await asyncio.wait_for(self._serving_event.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def not_served_for(self, timeout: float) -> None:
        """Return once the engine has not served for `timeout` seconds in a row, or has stopped."""
        while self.alive:
            await self._idle_event.wait()
            if not await self.wait_until_serving(timeout):
                return

    # ---- control (each runs in the engine thread between steps) ------------------------
    async def sleep(self, level: int = 1, mode: str = "wait"):
        return await self.call(self.engine.sleep, level, mode)

    async def wake_up(self, tags: list[str] | None = None):
        return await self.call(self.engine.wake_up, tags)

    async def reload_weights(self, path: str | None = None) -> None:
        return await self.call(self.engine.reload_weights, path)

    async def update_weights(self, named_tensors) -> int:
        return await self.call(self.engine.update_weights, named_tensors)

    async def is_sleeping(self) -> bool:
        return await self.call(self.engine.is_sleeping)

    async def memory_usage(self) -> dict:
        """The engine's memory usage; under tensor parallelism with every rank's ("ranks")."""
        return await self.call(self.engine.memory_usage)

    async def stats(self) -> dict:
        """Request counts and, with sleep mode, `memory_usage()`, read consistently between steps."""
        return await self.call(self._stats)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` in the engine thread between steps; its result or exception."""
        return await self.submit(fn, *args)

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Queue `fn(*args)` for the engine thread now (commands run in the order they were queued); the
        future resolves with its result or exception. Call from the event loop."""
        if not self.alive:
            raise EngineDeadError(f"the engine thread has stopped ({self.dead!r})")
        future = self._loop.create_future()
        self._inbox.put((fn, args, future))
        return future

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._inbox.put((fn, args, None))

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        finally:
            self.engine.served_by = None  # the engine is free for another driver again

    def _serve(self) -> None:
        try:
            _use_engine_device(self.engine)
            while True:
                try:
                    while True:  # commands first: they are cheap, and a sleep must not wait behind work
                        command = self._inbox.get(block=not self.engine.has_work())
                        if command is None:
                            self._fail_all(EngineDeadError("the server is shutting down"))
                            self._fail_commands(EngineDeadError("the server is shutting down"))
                            return
                        self._execute(command)
                except queue.Empty:
                    pass
                self._step()
        except BaseException as exc:  # a bug in this loop: say so to everyone waiting, then stop
            logger.exception("the engine thread died")
            self.dead = exc
            self._fail_all(EngineDeadError(f"the engine thread died: {exc!r}"))
            self._fail_commands(EngineDeadError(f"the engine thread died: {exc!r}"))
            self._post(self._serving_event.set)  # waiters for a wake get the error instead of hanging

    def _execute(self, command: _Command) -> None:
        fn, args, future = command
        result, error = None, None
        try:
            result = fn(*args)
        except Exception as exc:
            error = exc
        if not self.engine.serving:
            self._step()  # hands out what a sleep finished (drained or aborted); runs nothing
        self._publish_state()
        if future is not None:
            self._post(_resolve, future, result, error)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the requests it was serving")
            self._fail_all(EngineStepError(f"the engine failed while serving this request: "
                                           f"{type(exc).__name__}: {exc}"))
            return
        deliveries: list[tuple[asyncio.Queue, Any]] = []
        for output in outputs:
            request_queue = (self._queues.pop if output.finished else self._queues.get)(output.request_id, None)
            if request_queue is not None:
                deliveries.append((request_queue, output))
        if deliveries:
            self._post(_deliver, deliveries)

    def _add(self, request_id: str, token_ids: list[int], params: SamplingParams, stream: bool,
             request_queue: asyncio.Queue) -> None:
        self.engine.add_request(token_ids, params, request_id, stream)
        self._queues[request_id] = request_queue

    def _abort(self, request_id: str) -> None:
        if self._queues.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)

    def _fail_all(self, error: BaseException) -> None:
        deliveries = []
        for request_id, request_queue in list(self._queues.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("could not abort request %s", request_id)
            deliveries.append((request_queue, error))
        self._queues.clear()
        if deliveries:
            self._post(_deliver, deliveries)

    def _fail_commands(self, error: BaseException) -> None:
        """Answer every command still queued with `error` (the thread is ending)."""
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command is not None and command[2] is not None:
                self._post(_resolve, command[2], None, error)

    def _stats(self) -> dict:
        state = self.engine.state()
        memory = self.engine.memory_usage() if self.engine.sleep_mode is not None else None
        return {"num_running": state.num_running, "num_waiting": state.num_waiting, "serving": state.serving,
                "memory": memory, "prefix_cache": self.engine.prefix_cache_stats()}

    def _publish_state(self) -> None:
        state = self.engine.state()
        if state.serving != self.state.serving:
            self._post(self._serving_event.set if state.serving else self._serving_event.clear)
            self._post(self._idle_event.clear if state.serving else self._idle_event.set)
        self.state = state

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is waiting any more
            self._loop.call_soon_threadsafe(fn, *args)


class RequestStream:
    """The results of one queued request. `abort()` (idempotent) ends it early; call it in a `finally`."""

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.engine, self.request_id = engine, request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item

    async def result(self) -> RequestOutput:
        """The final output (streamed ones before it, if any, are skipped)."""
        async for item in self:
            if item.finished:
                return item
        raise EngineDeadError(f"request {self.request_id} ended without an output")

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` (what was delivered before it is read first) and abort the request."""
        if not self.finished:
            self.queue.put_nowait(error)
            self.engine._submit(self.engine._abort, self.request_id)

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine._submit(self.engine._abort, self.request_id)


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _deliver(deliveries: list[tuple[asyncio.Queue, Any]]) -> None:
    for request_queue, item in deliveries:
        request_queue.put_nowait(item)


def _use_engine_device(engine) -> None:
    """Make the engine's CUDA device current in this thread: a new thread starts on cuda:0, and the
    engine's kernels (Triton launches, graph replays) and tensors must be on its device (`--device cuda:1`,
    or rank 0 of a tensor-parallel engine placed after cuda:0)."""
    device = getattr(getattr(engine, "model_runner", None), "device", None)
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
