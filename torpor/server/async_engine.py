"""`AsyncEngine`: one `LLMEngine` driven by one thread, awaited from asyncio.

The engine thread is the only one that touches the engine. It runs every queued command (add or
abort a request, sleep, wake, reload, read memory) between steps, and steps while there is work.
Finished outputs and, for streaming requests, the tokens each step produced go back to the event
loop with `call_soon_threadsafe`. A step that raises fails the requests it was serving (they get the
error) and the thread goes on; a sleep or wake resolves only once it is complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from torpor.engine.outputs import RequestOutput, TokenLogprobs
from torpor.engine.sampling_params import SamplingParams
from torpor.engine.sequence import Sequence

logger = logging.getLogger("torpor.server")


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; nothing more can be served."""


class EngineStepError(RuntimeError):
    """An engine step raised; the requests it was serving were aborted (the engine thread goes on)."""


@dataclass
class TokenDelta:
    """Tokens a streaming request gained since its last delta (logprobs None unless asked for)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    index: int = 0  # the sample (completion) of the request these tokens belong to


@dataclass
class _Tracked:
    seq: Sequence
    queue: asyncio.Queue
    stream: bool
    samples: list[Sequence] = field(default_factory=list)  # the request's n samples, index order
    num_sent_by_index: dict[int, int] = field(default_factory=dict)  # output tokens handed out as deltas


_Command = tuple[Callable[..., Any], tuple, "asyncio.Future | None"]


class AsyncEngine:
    """Serves one `LLM` (whose engine it takes over: do not call the LLM's own methods meanwhile)."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.config = llm.config
        self.tokenizer = llm.tokenizer
        self.vocab_size = self.engine.vocab_size
        self._inbox: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._serving_event: asyncio.Event | None = None
        self.dead: BaseException | None = None
        # Written by the engine thread after every command, read by the loop.
        self.serving = not self.engine.scheduler.paused
        self.sleeping = self.engine.is_sleeping()

    # ---- life cycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will await the engine."""
        if self._thread is not None:
            raise RuntimeError("the AsyncEngine is already started")
        self._loop = asyncio.get_running_loop()
        self._serving_event = asyncio.Event()
        if self.serving:
            self._serving_event.set()
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
        """Queue a request; raises ValueError if the engine rejects it. Iterate the returned stream for
        `TokenDelta`s as tokens come (only with `stream`) and then the final `RequestOutput`."""
        request_stream = RequestStream(self, request_id)
        try:
            await self.call(self._add, request_id, prompt_token_ids, params, stream, request_stream.queue)
        except asyncio.CancelledError:  # the add still runs: abort after it (the inbox is FIFO)
            self._submit(self._abort, request_id)
            raise
        return request_stream

    async def wait_until_serving(self, timeout: float | None) -> bool:
        """True once the engine serves (awake, weights valid); False after `timeout` seconds."""
        try:
            await asyncio.wait_for(self._serving_event.wait(), timeout)
            return True
        except TimeoutError:
            return False

    # ---- control (each runs in the engine thread between steps) ------------------------
    async def sleep(self, level: int = 1, running: str = "wait"):
        return await self.call(self.engine.sleep, level, running)

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
        return await self.call(self._memory_usage)

    async def stats(self) -> dict:
        """Request counts and, with sleep mode, `memory_usage()`, read consistently between steps."""
        return await self.call(self._stats)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` in the engine thread between steps; its result or exception."""
        if not self.alive:
            raise EngineDeadError(f"the engine thread has stopped ({self.dead!r})")
        future = self._loop.create_future()
        self._inbox.put((fn, args, future))
        return await future

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._inbox.put((fn, args, None))

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            _use_engine_device(self.engine)
            while True:
                try:
                    while True:  # commands first: they are cheap, and a sleep must not wait behind work
                        command = self._inbox.get(block=not self._has_work())
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

    def _has_work(self) -> bool:
        return not self.engine.scheduler.paused and not self.engine.is_finished()

    def _execute(self, command: _Command) -> None:
        fn, args, future = command
        result, error = None, None
        try:
            result = fn(*args)
        except Exception as exc:
            error = exc
        if self.engine.scheduler.paused:
            self._step()  # hands out what a sleep finished (drained or aborted); runs nothing
        self._publish_state()
        if future is not None:
            self._post(_resolve, future, result, error)

    def _step(self) -> None:
        try:
            finished = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the requests it was serving")
            self._fail_all(EngineStepError(f"the engine failed while serving this request: "
                                           f"{type(exc).__name__}: {exc}"))
            return
        deliveries: list[tuple[asyncio.Queue, Any]] = []
        for output in finished:
            tracked = self._tracked.pop(output.request_id, None)
            if tracked is not None:
                deliveries.append((tracked.queue, output))
        for tracked in self._tracked.values():
            for seq in tracked.samples if tracked.stream else ():
                start = tracked.num_sent_by_index.get(seq.index, 0)
                if seq.num_output_tokens > start:
                    tracked.num_sent_by_index[seq.index] = seq.num_output_tokens
                    logprobs = seq.output_logprobs[start:] if seq.sampling_params.logprobs is not None else None
                    deliveries.append((tracked.queue, TokenDelta(seq.output_token_ids[start:], logprobs, seq.index)))
        if deliveries:
            self._post(_deliver, deliveries)

    def _add(self, request_id: str, token_ids: list[int], params: SamplingParams, stream: bool,
             request_queue: asyncio.Queue) -> None:
        seq = self.engine.make_sequence(token_ids, params, request_id)
        self.engine.add_sequence(seq)
        self._tracked[request_id] = _Tracked(seq, request_queue, stream,
                                             samples=list(self.engine.scheduler.samples(request_id)))

    def _abort(self, request_id: str) -> None:
        if self._tracked.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)

    def _fail_all(self, error: BaseException) -> None:
        deliveries = []
        for request_id, tracked in list(self._tracked.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("could not abort request %s", request_id)
            deliveries.append((tracked.queue, error))
        self._tracked.clear()
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

    def _memory_usage(self) -> dict:
        if self.config.tensor_parallel_size == 1:
            return self.engine.memory_usage()
        from torpor.engine.parallel_runner import usage_with_ranks

        return usage_with_ranks(self.engine)

    def _stats(self) -> dict:
        scheduler = self.engine.scheduler
        memory = self.engine.memory_usage() if self.engine.sleep_mode is not None else None
        return {"num_running": len(scheduler.running), "num_waiting": len(scheduler.waiting),
                "serving": not scheduler.paused, "memory": memory,
                "prefix_cache": self.engine.prefix_cache_stats()}

    def _publish_state(self) -> None:
        self.sleeping = self.engine.is_sleeping()
        serving = not self.engine.scheduler.paused
        if serving != self.serving:
            self.serving = serving
            self._post(self._serving_event.set if serving else self._serving_event.clear)

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is waiting any more
            self._loop.call_soon_threadsafe(fn, *args)


class RequestStream:
    """The results of one queued request. `abort()` (idempotent) ends it early; call it in a `finally`."""

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.engine, self.request_id = engine, request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[TokenDelta | RequestOutput]:
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = isinstance(item, RequestOutput)
            yield item

    async def result(self) -> RequestOutput:
        """The final output (deltas, if any, are skipped)."""
        async for item in self:
            if isinstance(item, RequestOutput):
                return item
        raise EngineDeadError(f"request {self.request_id} ended without an output")

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
