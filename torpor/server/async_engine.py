"""`AsyncEngine`: one `LLMEngine` driven by one thread, with a typed asynchronous API for the server.

The engine thread is the only one that touches the engine. It runs every queued command (add or abort a
request, sleep, wake, reload, an update, a reading) between steps, and steps while there is work; otherwise it
blocks on its inbox (it never spins). The engine's outputs (finished ones and, for streaming requests, each
step's text and token deltas) go back to the event loop with `call_soon_threadsafe`. The engine's state is
published after every command. A step that raises fails the requests it was serving (they get the error) and the
thread goes on; a sleep or wake resolves only once it is complete. A command that completes later (a pause that
waits for the running requests, a flush that waits for none to run) leaves a waiter, checked after every command
and step, with its deadline. Every control operation is logged: one INFO
line when it succeeds (what, level or tags, seconds, bytes), a WARNING when it fails.

The routes call only this API (never the `LLMEngine` behind it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from torpor.engine.lifecycle import DEFERRED_TAGS, EngineState, LifecycleError
from torpor.engine.llm_engine import LLMEngine, WakeResult
from torpor.engine.outputs import RequestOutput
from torpor.engine.sampling_params import SamplingParams
from torpor.engine.weights.receiver import PushPosition, StagedUpdate
from torpor.memory import Report
from torpor.server.async_transfer import RECEIVE_POLL_S, TransferCalls, log_failure

logger = logging.getLogger("torpor.server")


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; nothing more can be served."""


class EngineStepError(RuntimeError):
    """An engine step raised; the requests it was serving were aborted (the engine thread goes on)."""


@dataclass(frozen=True)
class SleepResult:
    """What a sleep (or a release of tags) did: its memory report (None: nothing was released), the level after it,
    whether it changed the level, and the seconds of the whole sleep on the engine thread (waiting for running
    requests included; the report's are the memory's part)."""

    report: Report | None
    level: int | None
    changed: bool
    seconds: float


_Command = tuple[Callable[..., Any], tuple, "asyncio.Future | None"]


@dataclass(eq=False)
class _Waiter:
    """A command that answers later, on the engine thread: once `ready()` holds (checked after every command and
    every step) with `then()`, or past `deadline` (monotonic seconds; None: none) with `expired()`."""

    ready: Callable[[], bool]
    then: Callable[[], Any]
    expired: Callable[[], Any]
    deadline: float | None
    future: asyncio.Future | None = None


class AsyncEngine(TransferCalls):
    """Serves one `LLMEngine`; once started, only the engine thread touches it."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.vocab_size
        self._inbox: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue] = {}  # request id -> its stream's queue; engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._serving_event: asyncio.Event | None = None
        self._idle_event: asyncio.Event | None = None  # set while the engine does not serve
        self.dead: BaseException | None = None
        self.state: EngineState = engine.state()  # written by the engine thread after every command
        self._waiters: list[_Waiter] = []  # engine thread only

    @property
    def serving(self) -> bool:
        return self.state.serving

    @property
    def sleeping(self) -> bool:
        return self.state.is_sleeping

    @property
    def weight_version(self) -> str:
        """The label of the weights served (any thread: a string read)."""
        return self._engine.weight_version

    @property
    def world_size(self) -> int:
        """The engine's ranks (tensor parallel; no pipeline or data parallelism)."""
        return self._engine.executor.world_size

    def state_fields(self) -> dict:
        """What every control answer carries: whether a sleep level is set and whether requests run."""
        return {"is_sleeping": self.sleeping, "serving": self.serving}

    def health(self) -> str | None:
        """Why the engine cannot serve (its thread stopped, a dead or stopped worker), or None. Any thread."""
        if not self.alive:
            return f"the engine thread has stopped ({self.dead!r})"
        return self._engine.health()

    # ---- life cycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will await the engine."""
        if self._thread is not None:
            raise RuntimeError("the AsyncEngine is already started")
        if self._engine.served_by is not None:
            raise RuntimeError(f"the engine is already served by {self._engine.served_by}")
        self._engine.served_by = "a running AsyncEngine (the server)"
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
        return (await self.add_requests([(request_id, prompt_token_ids, params)], stream))[0]

    async def add_requests(self, requests: list[tuple[str, list[int], SamplingParams]],
                           stream: bool = False) -> list[RequestStream]:
        """Queue several requests (id, prompt token ids, params) at once, all or none: one command of the engine
        thread, so they enter the same step (added one by one, each would wait for a step: 256 prompts of one
        completions body took 6.3 s on an H100 where one step takes ~25 ms). Raises ValueError, none queued, if the
        engine rejects one. Returns a stream per request, in order (see `add_request`)."""
        streams = [RequestStream(self, request_id) for request_id, _, _ in requests]
        items = [(*request, stream, s.queue) for request, s in zip(requests, streams, strict=True)]
        try:
            await self._call(self._add_all, items)
        except asyncio.CancelledError:  # the adds still run: abort after them (the inbox is FIFO)
            for request_id, _, _ in requests:
                self._submit(self._abort, request_id)
            raise
        return streams

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise the engine's `RequestError` if it would refuse this request (asleep or not; reads only
        the tokenizer and the configuration, so any thread may call it)."""
        self._engine.make_sequence(prompt_token_ids, params, "check")

    async def wait_until_serving(self, timeout: float | None) -> bool:
        """True once the engine serves (awake, weights whole); False after `timeout` seconds."""
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
    async def sleep(self, level: int = 1, mode: str = "wait") -> SleepResult:
        return await self._control("sleep", f"level {level}", self._sleep, self._engine.sleep, level, mode)

    async def release_tags(self, tags: list[str], mode: str = "wait", strict: bool = False) -> SleepResult:
        """`strict` (SGLang's routes): a tag that sleeps already is a ValueError naming it, nothing released."""
        release = self._release_strict if strict else self._engine.release_tags
        return await self._control("release", f"tags {tags}", self._sleep, release, tags, mode)

    def _release_strict(self, tags: list[str], mode: str) -> Report | None:
        asleep = [t for t in tags if self._engine.lifecycle.is_asleep(t)]
        if asleep:
            raise ValueError(f"release_memory_occupation: tag(s) {asleep} are released already; "
                             "resume_memory_occupation first")
        return self._engine.release_tags(tags, mode)

    def _sleep(self, operation: Callable[..., Report | None], *args: Any) -> SleepResult:
        before, start = self._engine.lifecycle.level, time.perf_counter()
        report = operation(*args)
        after = self._engine.lifecycle.level
        return SleepResult(report, after, after != before, time.perf_counter() - start)

    async def wake_up(self, tags: list[str] | None = None, strict: bool = False) -> WakeResult:
        """`strict` (SGLang's routes): a named tag that is not released is a ValueError naming it, nothing woken
        (`weights` and `kv_cache` always; the others only while nothing sleeps, since any wake restores them)."""
        wake = self._wake_strict if strict and tags is not None else self._engine.wake_up
        return await self._control("wake_up", f"tags {tags or 'all'}", wake, tags)

    def _wake_strict(self, tags: list[str]) -> WakeResult:
        lc = self._engine.lifecycle
        nothing_asleep = not any(lc.is_asleep(t) for t in lc.tags)
        awake = [t for t in tags if t in lc.tags and not lc.is_asleep(t) and (t in DEFERRED_TAGS or nothing_asleep)]
        if awake:
            raise ValueError(f"resume_memory_occupation: tag(s) {awake} are not released")
        return self._engine.wake_up(tags)

    async def reload_weights(self, path: str | None = None) -> float:
        """The reload's seconds on the engine thread."""
        return await self._control("reload_weights", path or "the model's checkpoint", _timed_call,
                                   self._engine.reload_weights, path)

    async def update_weights(self, named_tensors) -> int:
        return await self._control("update_weights", "in process", self._engine.update_weights, named_tensors)

    async def update_weights_from_tensor(self, serialized: list[str], load_format: str | None, flush_cache: bool,
                                         push: PushPosition | None, version: str | None = None) -> int:
        """A whole request on the engine thread (the pipeline's path when nothing is in flight beside it)."""
        return await self._call(self.push_unstaged, serialized, load_format, flush_cache, push, version)

    def push_unstaged(self, serialized, load_format: str | None, flush_cache: bool,
                      push: PushPosition | None, version: str | None = None) -> int:
        """Engine thread (the pipeline queues it in its push's order); `version`: the weights' label once the
        update commits."""
        with self._engine.weights.keeping(push):
            return self._engine.update_weights_from_tensor(serialized, load_format, flush_cache, None, push, version)

    def stage(self, serialized: list[str], load_format: str | None) -> StagedUpdate:
        """The pipeline's staging thread: open and check a payload while the engine thread copies another."""
        return self._engine.weights.stage(serialized, load_format)

    def push_staged(self, staged: StagedUpdate, flush_cache: bool, push: PushPosition | None,
                    version: str | None = None) -> int:
        """Engine thread: the copy of a staged payload."""
        with self._engine.weights.keeping(push):
            return self._engine.weights.apply_staged(staged, flush_cache, push, version)

    def discard_staged(self, staged: StagedUpdate) -> None:
        """Engine thread: release a staged payload that will not be copied."""
        self._engine.weights.discard_staged(staged)

    def end_push(self, push_id: str, reason: str | None) -> None:
        """Engine thread: a push that will send nothing more (`reason`: why it is given up; None: it ended) keeps
        nothing of its trainer's memory, and one still in progress ends as a failure."""
        if reason is None:
            self._engine.weights.forget(push_id)
        elif self._engine.weights.abandon(push_id, reason):
            logger.warning("weight push %s abandoned: %s", push_id, reason)

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Queue `fn(*args)` — one of this class's engine-thread methods — for the engine thread now (commands run
        in the order they were queued); the future resolves with its result or exception. Call from the loop."""
        if not self.alive:
            raise EngineDeadError(f"the engine thread has stopped ({self.dead!r})")
        future = self._loop.create_future()
        self._inbox.put((fn, args, future))
        return future

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str | None,
                                        timeout: float) -> None:
        what = f"group {group_name!r} at {master_address}:{master_port}, ranks from {rank_offset} of {world_size}"
        if self.config.tensor_parallel_size == 1:
            # The rendezvous waits for the trainer: off the engine thread, so requests keep being served.
            start = time.perf_counter()
            try:
                await asyncio.to_thread(self._engine.init_weights_update_group, master_address, master_port,
                                        rank_offset, world_size, group_name, backend, timeout)
            except Exception as exc:
                log_failure("init_weights_update_group", what, exc)
                raise
            logger.info("init_weights_update_group %s: %.3f s", what, time.perf_counter() - start)
            return
        await self._control("init_weights_update_group", what, self._engine.init_weights_update_group,
                            master_address, master_port, rank_offset, world_size, group_name, backend, timeout)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, flush_cache: bool, timeout: float,
                                              version: str | None = None) -> int:
        """Every rank receives the trainer's broadcasts on a thread of its own while the engine thread goes on
        serving on the old weights; once all arrived, the copy runs on the engine thread. A trainer that stops
        broadcasting is given up after `timeout` seconds (the group is destroyed, nothing was written)."""
        what = f"{len(names)} tensors from group {group_name!r}"
        start = time.perf_counter()
        weights = self._engine.weights
        try:
            await self._call(weights.start_receive, names, dtypes, shapes, group_name, timeout)
            deadline = time.monotonic() + timeout + 1.0  # the receive ends by its own deadline first
            while not await self._call(weights.receive_done, group_name):
                if time.monotonic() > deadline:
                    await self._call(weights.wait_receive, group_name, 0.0, timeout)  # gives the group up, raises
                await asyncio.sleep(RECEIVE_POLL_S)
            count = await self._call(weights.apply_received, names, group_name, flush_cache, None, version)
        except Exception as exc:
            log_failure("update_weights_from_distributed", what, exc)
            raise
        logger.info("update_weights_from_distributed %s: %.3f s", what, time.perf_counter() - start)
        return count

    async def worker_rpc(self, method: str, args: tuple, kwargs: dict | None, timeout: float | None) -> list:
        return await self._control("collective_rpc", method, self._engine.worker_rpc, method, args, kwargs, timeout)

    async def get_weights_by_name(self, name: str, truncate_size: int) -> list:
        return await self._call(self._engine.get_weights_by_name, name, truncate_size)

    async def update_weights_from_disk(self, path: str, version: str | None, abort_all: bool, flush_cache: bool,
                                       empty_cache: bool) -> int:
        """SGLang's reload: the requests in the engine are aborted first (`abort_all`) or held while it loads; their
        count (SGLang's num_paused_requests)."""
        return await self._control("update_weights_from_disk", path, self._from_disk, path, version, abort_all,
                                   flush_cache, empty_cache)

    def _from_disk(self, path: str, version: str | None, abort_all: bool, flush_cache: bool,
                   empty_cache: bool) -> int:
        engine = self._engine
        if abort_all:
            engine.abort_requests(None)
            self._step()  # hands out the aborted outputs now (nothing is left to run)
        state = engine.state()
        held = state.num_running + state.num_waiting
        engine.reload_weights(path, version, flush_cache)
        if empty_cache and engine.executor.driver.device.type == "cuda":
            torch.cuda.empty_cache()
        return held

    async def destroy_weights_update_group(self, group_name: str) -> None:
        return await self._control("destroy_weights_update_group", repr(group_name),
                                   self._engine.destroy_weights_update_group, group_name)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return await self._call(self._engine.reset_prefix_cache, reset_running_requests)

    async def flush_cache(self, timeout: float = 0.0) -> tuple[bool, str]:
        """SGLang's flush: the prefix cache reset once no request runs or waits, waiting at most `timeout` seconds
        for that; (done, why not)."""
        return await self._call(self._flush, timeout)

    # ---- pause, resume, abort, weight labels ---------------------------------------------------
    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True,
                               timeout: float | None = None) -> None:
        """`LLMEngine.pause_generation`; with "wait" the engine thread goes on stepping (and answering commands)
        until the running requests finished, at most `timeout` seconds (None: as long as they run)."""
        await self._control("pause_generation", f"mode {mode}", self._pause, mode, clear_cache, timeout)

    async def resume_generation(self, empty_cache: bool = False) -> None:
        await self._control("resume_generation", "", self._engine.resume_generation, empty_cache)

    async def is_paused(self) -> bool:
        return await self._call(self._engine.is_paused)

    async def abort_requests(self, request_ids: list[str] | None = None, prefix: str | None = None) -> int:
        """Abort the given requests (None: every one; `prefix`: those whose id starts with it, SGLang's match),
        without pausing; their streams end with finish_reason "abort". Returns how many were aborted."""
        return await self._control("abort_requests", f"{len(request_ids or ())} ids" if prefix is None else
                                   f"ids starting with {prefix!r}", self._abort_requests, request_ids, prefix)

    async def update_weight_version(self, version: str) -> None:
        """Label the weights (between two steps: every token after it carries the new label)."""
        await self._control("update_weight_version", repr(version), self._engine.update_weight_version, version)

    async def is_sleeping(self) -> bool:
        return await self._call(self._engine.is_sleeping)

    async def memory_usage(self) -> dict:
        """The engine's memory usage; under tensor parallelism with every rank's ("ranks")."""
        return await self._call(self._engine.memory_usage)

    async def stats(self) -> dict:
        """Request counts and, with sleep mode, `memory_usage()`, read consistently between steps."""
        return await self._call(self._stats)

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                             timeout: float | None = None) -> list:
        return await self._control("collective_rpc", method, self._engine.collective_rpc, method, args, kwargs,
                                   timeout)

    async def _control(self, name: str, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A control operation on the engine thread, logged: INFO with its seconds (and bytes), WARNING when it
        fails."""
        start = time.perf_counter()
        try:
            result = await self._call(fn, *args)
        except Exception as exc:
            log_failure(name, what, exc)
            raise
        logger.info("%s %s: %.3f s%s", name, what, time.perf_counter() - start, _bytes_moved(result))
        return result

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self.submit(fn, *args)

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._inbox.put((fn, args, None))

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        finally:
            self._engine.served_by = None  # the engine is free for another driver again

    def _serve(self) -> None:
        try:
            device = self._engine.executor.driver.device
            if device.type == "cuda":
                torch.cuda.set_device(device)  # a new thread starts on cuda:0; the engine's kernels go to its device
            while True:
                try:
                    while True:  # commands first: they are cheap, and a sleep must not wait behind work
                        command = self._inbox.get(block=not self._engine.has_work(), timeout=self._next_deadline())
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
        if not self._engine.serving or self._engine.has_pending_outputs():
            self._step()  # hands out what a sleep or an abort finished (drained or aborted)
        self._publish_state()
        if isinstance(result, _Waiter):  # it answers later (checked now, then after every command and step)
            result.future = future
            self._waiters.append(result)
        elif future is not None:
            self._post(_resolve, future, result, error)
        self._check_waiters()

    def _check_waiters(self) -> None:
        if not self._waiters:
            return
        now = time.monotonic()
        for waiter in list(self._waiters):
            ready = waiter.ready()
            if not ready and (waiter.deadline is None or now < waiter.deadline):
                continue
            self._waiters.remove(waiter)
            result, error = None, None
            try:
                result = waiter.then() if ready else waiter.expired()
            except Exception as exc:
                error = exc
            self._publish_state()
            if waiter.future is not None:
                self._post(_resolve, waiter.future, result, error)

    def _next_deadline(self) -> float | None:
        """Seconds until the nearest waiter's deadline (None: none has one): how long the idle thread may block."""
        deadlines = [w.deadline for w in self._waiters if w.deadline is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _pause(self, mode: str, clear_cache: bool, timeout: float | None) -> _Waiter | None:
        """Engine thread: the pause at once, or (mode "wait" with requests running) a waiter that completes it once
        none runs. If they cannot finish (a sleep froze them) or `timeout` passes, the pause is undone."""
        engine, lc = self._engine, self._engine.lifecycle
        before = lc.paused
        if engine.begin_pause(mode, clear_cache):
            return None
        scheduler = engine.scheduler

        def stuck() -> bool:  # a sleep or another pause froze them (an update in progress ends by itself)
            return not lc.may_run() and lc.updating is None

        def then() -> None:
            if scheduler.running:
                undo()
                raise LifecycleError(f"pause_generation(mode='wait'): {len(scheduler.running)} running requests cannot "
                                     f"finish: {engine.state().not_serving_reason()}; the pause is undone")
            engine.finish_pause(clear_cache)

        def expired() -> None:
            undo()
            raise LifecycleError(f"pause_generation(mode='wait'): {len(scheduler.running)} requests still ran after "
                                 f"{timeout:g} s; the pause is undone")

        def undo() -> None:
            if lc.paused != "new":  # another pause (or a resume) came since: it stands
                return
            if before is None:
                lc.resume()
            else:
                lc.pause(before)

        return _Waiter(lambda: not scheduler.running or stuck(), then, expired,
                       None if timeout is None else time.monotonic() + timeout)

    def _flush(self, timeout: float) -> _Waiter:
        scheduler = self._engine.scheduler

        def refused() -> tuple[bool, str]:
            return False, (f"Cache not flushed because there are pending requests. #queue-req: "
                           f"{len(scheduler.waiting)}, #running-req: {len(scheduler.running)}")

        def flush() -> tuple[bool, str]:
            self._engine.reset_prefix_cache()
            return True, ""

        return _Waiter(scheduler.is_finished, flush, refused, time.monotonic() + timeout)

    def _abort_requests(self, request_ids: list[str] | None, prefix: str | None) -> int:
        if prefix is not None:
            request_ids = [r for r in self._engine.request_ids() if r.startswith(prefix)]
        return len(self._engine.abort_requests(request_ids))

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the requests it was serving")
            self._fail_all(EngineStepError(f"the engine failed while serving this request: "
                                           f"{type(exc).__name__}: {exc}"))
            self._publish_state()
            return
        deliveries: list[tuple[asyncio.Queue, Any]] = []
        for output in outputs:
            request_queue = (self._queues.pop if output.finished else self._queues.get)(output.request_id, None)
            if request_queue is not None:
                deliveries.append((request_queue, output))
        if deliveries:
            self._post(_deliver, deliveries)
        self._check_waiters()

    def _add_all(self, items: list[tuple[str, list[int], SamplingParams, bool, asyncio.Queue]]) -> None:
        added: list[str] = []
        try:
            for request_id, token_ids, params, stream, request_queue in items:
                self._engine.add_request(token_ids, params, request_id, stream)
                self._queues[request_id] = request_queue
                added.append(request_id)
        except BaseException:
            for request_id in added:  # all or none
                self._abort(request_id)
            raise

    def _abort(self, request_id: str) -> None:
        if self._queues.pop(request_id, None) is not None:
            self._engine.abort_request(request_id)

    def _fail_all(self, error: BaseException) -> None:
        deliveries = []
        for request_id, request_queue in list(self._queues.items()):
            try:
                self._engine.abort_request(request_id)
            except Exception:
                logger.exception("could not abort request %s", request_id)
            deliveries.append((request_queue, error))
        self._queues.clear()
        if deliveries:
            self._post(_deliver, deliveries)

    def _fail_commands(self, error: BaseException) -> None:
        """Answer every command still queued (or waiting) with `error` (the thread is ending)."""
        for waiter in self._waiters:
            if waiter.future is not None:
                self._post(_resolve, waiter.future, None, error)
        self._waiters.clear()
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command is not None and command[2] is not None:
                self._post(_resolve, command[2], None, error)

    def _stats(self) -> dict:
        state = self._engine.state()
        memory = self._engine.memory_usage() if self._engine.memory is not None else None
        return {"num_running": state.num_running, "num_waiting": state.num_waiting, "serving": state.serving,
                "sleep_level": state.sleep_level, "paused": state.paused, "memory": memory,
                "prefix_cache": self._engine.prefix_cache_stats()}

    def _publish_state(self) -> None:
        state = self._engine.state()
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


def _timed_call(fn: Callable[..., Any], *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def _bytes_moved(result: Any) -> str:
    """", 15.26 GB" for a result that carries a memory report (a sleep's, a wake's), else nothing."""
    report = getattr(result, "report", None)
    moved = 0 if report is None else report.bytes_copied + report.bytes_released + report.bytes_mapped
    return f", {moved / 1e9:.2f} GB moved" if moved else ""
