"""Pushes in flight: `POST /update_weights_from_tensor` requests overlap without giving up their order.

A request that arrives while another is in flight is opened and checked off the engine thread, on one staging
thread (`WeightReceiver.stage`: base64, the restricted unpickler, the shared-memory files or CUDA IPC handles,
every name / shape / dtype against the manifest and the model, the finite values), while the engine thread copies
the previous request; the engine thread then does only the copy, the synchronization and the release
(`WeightReceiver.apply_staged`). A request that finds none in flight runs wholly on the engine thread, as before.
Commands reach the engine thread in the order they are queued, and a request is queued only when it is its turn:

- Without torpor's push headers (any SGLang client) a request is queued once staged, in the order the requests
  were staged (one staging thread, first come first served) — one at a time, as before, for a client that
  waits for each answer.
- With them (`X-Torpor-Push-Id: <id>`, `X-Torpor-Push-Index: <0, 1, ...>`, sent by `WeightPusher`, which
  keeps several requests in flight), the requests of one push are queued in index order whatever order they
  arrive in, and once one of them failed (refused, or its copy failed) every later one writes nothing and
  answers 409: a push fails at its first failed request, exactly as when the trainer sent nothing after it.

Under tensor parallelism, or for a payload that is not one entry, the request runs on the engine thread as
before (its order and failure rule still apply).

A push with the headers is one weight update (`WeightReceiver.write`): from its first write until the request
marked `X-Torpor-Push-Last: 1` commits, nothing runs, and a push that fails, or sends nothing for
`ServerConfig.push_idle_timeout_s`, ends as a failure — the old weights come back from their host copy when they
can, else the engine does not serve until a complete update or a reload. Never a mix.

A push whose trainer flattens its buckets into a few buffers reused in turn (`X-Torpor-Push-Keep: <n>`, sent by
`WeightPusher.push` with its `torpor.rl.BucketRing`) has the storages the engine opened kept between its requests
(`WeightReceiver.keeping`, at most MAX_KEPT), so each buffer is mapped once per push; they are released after its
last request, after its first failure, by a sleep of the weights, or when no request of the push came for
`push_idle_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torpor.engine import phase_times
from torpor.engine.weights.receiver import PushPosition, StagedUpdate

if TYPE_CHECKING:
    from torpor.server.async_engine import AsyncEngine

PUSH_ID_HEADER = "x-torpor-push-id"
PUSH_INDEX_HEADER = "x-torpor-push-index"
PUSH_KEEP_HEADER = "x-torpor-push-keep"  # the buffers the trainer cycles through (torpor.rl.BucketRing)
PUSH_LAST_HEADER = "x-torpor-push-last"  # "1" on a push's last request
TURN_TIMEOUT_S = 60.0  # how long a request waits for the one before it in its push
MAX_PUSHES = 64  # pushes whose order is remembered (the oldest is forgotten first)
MAX_KEPT = 16  # mappings of a trainer's memory kept open per push, at most


def push_position(headers: Mapping[str, str]) -> PushPosition | None:
    """The push headers of a request, None without them; ValueError (a 400) when malformed."""
    push_id, index = headers.get(PUSH_ID_HEADER), headers.get(PUSH_INDEX_HEADER)
    keep, last = headers.get(PUSH_KEEP_HEADER, "0"), headers.get(PUSH_LAST_HEADER, "0")
    if push_id is None and index is None:
        return None
    if not push_id or len(push_id) > 128 or index is None or not index.isdigit() or len(index) > 9:
        raise ValueError(f"{PUSH_ID_HEADER} (1-128 characters) and {PUSH_INDEX_HEADER} (0, 1, ...) go together")
    if not keep.isdigit() or len(keep) > 3 or last not in ("0", "1"):
        raise ValueError(f"{PUSH_KEEP_HEADER} is a count (0-999) and {PUSH_LAST_HEADER} is 0 or 1")
    return PushPosition(push_id, int(index), min(int(keep), MAX_KEPT), last == "1")


@dataclass
class PushOrder:
    """The requests of one push: request i is queued for the engine thread only after request i-1 was
    (`next`), and none after the first one that failed (`failed_at`), whichever thread saw the failure."""

    next: int = 0
    failed_at: int | None = None
    reason: str = ""
    turn: asyncio.Condition = field(default_factory=asyncio.Condition)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, index: int, reason: str) -> None:
        with self.lock:
            if self.failed_at is None or index < self.failed_at:
                self.failed_at, self.reason = index, reason

    def refusal(self, index: int) -> str | None:
        """Why request `index` must write nothing (an earlier one failed), or None."""
        with self.lock:
            if self.failed_at is None or self.failed_at >= index:
                return None
            return (f"weight update refused, nothing was written: request {self.failed_at} of this push failed "
                    f"({self.reason}), so the requests after it are not applied")

    async def wait_turn(self, index: int, timeout: float) -> None:
        """Until every request before `index` was queued; TimeoutError when one never came."""
        if index < self.next:
            raise ValueError(f"request {index} of this push came twice, or after its turn")
        async with self.turn:
            await asyncio.wait_for(self.turn.wait_for(lambda: self.next >= index), timeout)

    async def pass_turn(self, index: int) -> None:
        async with self.turn:
            self.next = max(self.next, index + 1)
            self.turn.notify_all()


class WeightPipeline:
    """One server's pushes: the staging thread and the order of each push (see the module docstring)."""

    def __init__(self, engine: AsyncEngine, idle_timeout_s: float = 10.0) -> None:
        self.engine, self.idle_timeout_s = engine, idle_timeout_s
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="torpor-weights-stage")
        self._pushes: OrderedDict[str, PushOrder] = OrderedDict()
        self._active = 0  # requests between their arrival and their answer
        self._forget_timers: dict[str, asyncio.TimerHandle] = {}  # a push's kept mappings, released when idle
        # One weight update at a time: the push (or headerless request) holding the engine's update; the first request
        # of another waits here until it ends (its last request, its failure, or its idle timeout).
        self._holder: object | None = None
        self._slot = asyncio.Condition()

    def close(self) -> None:
        self._stager.shutdown(wait=False, cancel_futures=True)
        for timer in self._forget_timers.values():
            timer.cancel()

    async def update(self, serialized: Any, load_format: str | None, flush_cache: bool,
                     push: PushPosition | None, version: str | None = None) -> tuple[int, dict[str, float]]:
        """One request: (tensors loaded, seconds per phase: the engine thread's, plus `stage` and its phases
        when it was staged off the engine thread). A request that finds no other in flight runs wholly on the
        engine thread (nothing to overlap with: a thread hop less); one that finds another is staged. `version`:
        the weights' label once the update commits (with this request or, in a push, its last)."""
        self._active += 1
        failed = False
        owner = object() if push is None else push.push_id
        try:
            return await self._update(serialized, load_format, flush_cache, push, owner, version)
        except BaseException as exc:
            order = None if push is None else self._pushes.get(push.push_id)
            if order is not None and order.failed_at is not None:  # the push failed: it ends now, as a failure
                failed = True
                self._forget(push.push_id, f"request {order.failed_at} of it failed ({type(exc).__name__})")
            raise
        finally:
            self._active -= 1
            if push is None or push.last or failed:
                await self._release(owner)
            if push is not None and not failed:
                self._forget_when_idle(push)

    async def _acquire(self, owner: object) -> None:
        """Wait (at most TURN_TIMEOUT_S) until no other update is in progress, then hold the engine's update."""
        async with self._slot:
            try:
                await asyncio.wait_for(self._slot.wait_for(lambda: self._holder in (None, owner)), TURN_TIMEOUT_S)
            except TimeoutError:
                raise RuntimeError(f"another weight update ({self._holder!r}) was still in progress after "
                                   f"{TURN_TIMEOUT_S:g} s; nothing was written") from None
            self._holder = owner

    async def _release(self, owner: object) -> None:
        async with self._slot:
            if self._holder == owner:
                self._holder = None
                self._slot.notify_all()

    async def _update(self, serialized: Any, load_format: str | None, flush_cache: bool,
                      push: PushPosition | None, owner: object, version: str | None) -> tuple[int, dict[str, float]]:
        if not isinstance(flush_cache, bool):
            raise ValueError(f"flush_cache must be true or false, got {flush_cache!r}")
        order = self._order(push)
        index = push.index if push is not None else 0
        if order is not None and index < order.next:
            raise ValueError(f"request {index} of push {push.push_id!r} came twice, or after its turn")
        refusal = order.refusal(index) if order is not None else None
        if refusal is not None:  # an earlier request failed: nothing of this one is opened
            await self._skip_turn(order, index)
            raise RuntimeError(refusal)
        if not self._stageable(serialized):
            return await self._in_turn(order, index, owner, self._unstaged, serialized, load_format, flush_cache, push,
                                       version)
        staged = await self._stage(order, index, serialized, load_format)
        count, timings = await self._in_turn(order, index, owner, self._apply, staged, flush_cache, push, version,
                                             staged=staged)
        return count, _merged(staged.timings, timings)

    def _order(self, push: PushPosition | None) -> PushOrder | None:
        if push is None:
            return None
        order = self._pushes.get(push.push_id)
        if order is None:
            order = self._pushes[push.push_id] = PushOrder()
            while len(self._pushes) > MAX_PUSHES:
                self._forget(self._pushes.popitem(last=False)[0])
        return order

    def _stageable(self, serialized: Any) -> bool:
        """Whether to stage this request off the engine thread: another is in flight, TP=1, one entry."""
        return self._active > 1 and self.engine.config.tensor_parallel_size == 1 and isinstance(serialized, list) \
            and len(serialized) == 1

    # ---- the end of a push: its kept mappings released, an unfinished one given up -------------------------
    def _forget(self, push_id: str, reason: str | None = None) -> None:
        """The push ended (`reason` None) or is given up (`reason`): on the engine thread, as every release of a
        trainer's memory, its kept storages go, and an update of it still in progress ends as a failure."""
        timer = self._forget_timers.pop(push_id, None)
        if timer is not None:
            timer.cancel()
        if self.engine.alive:
            self.engine.submit(self.engine.end_push, push_id, reason)
        if reason is not None:  # given up: the next update may go
            asyncio.get_running_loop().create_task(self._release(push_id))

    def _forget_when_idle(self, push: PushPosition) -> None:
        """A push that sends nothing for `idle_timeout_s` (its trainer died, or stalled) keeps nothing open and, if
        its update is still in progress, is given up: nothing runs while an update is in progress."""
        timer = self._forget_timers.pop(push.push_id, None)
        if timer is not None:
            timer.cancel()
        if not push.last:
            self._forget_timers[push.push_id] = asyncio.get_running_loop().call_later(
                self.idle_timeout_s, self._forget, push.push_id, f"no request of it came for {self.idle_timeout_s:g} s")

    async def _stage(self, order: PushOrder | None, index: int, serialized: list[str],
                     load_format: str | None) -> StagedUpdate:
        """The payload opened and checked on the staging thread. A failure fails the push from this request on
        (once its turn came, so the order of the turns holds)."""
        future = asyncio.get_running_loop().run_in_executor(self._stager, self.engine.stage, serialized, load_format)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:  # the handler went away: the staged tensors must not stay mapped
            future.add_done_callback(self._discard)
            raise
        except Exception as exc:
            if order is not None:
                order.fail(index, f"{type(exc).__name__}: {exc}")
                await self._skip_turn(order, index)
            raise

    async def _in_turn(self, order: PushOrder | None, index: int, owner: object, fn: Callable[..., int], *args: Any,
                       staged: StagedUpdate | None = None) -> tuple[int, dict[str, float]]:
        """Queue `fn(order, index, *args)` for the engine thread once it is this request's turn (its push's, and for
        a push's first request, or a request without one, once no other update is in progress); its result."""
        if order is not None:
            try:
                await order.wait_turn(index, TURN_TIMEOUT_S)
            except (TimeoutError, ValueError) as exc:
                if staged is not None:
                    self.engine.submit(self.engine.discard_staged, staged)
                if isinstance(exc, ValueError):  # a repeated index: refused, the push goes on (not its turn)
                    raise
                reason = f"request {index - 1} of this push never came within {TURN_TIMEOUT_S:g} s"
                order.fail(index, reason)
                await order.pass_turn(index)
                raise RuntimeError(reason) from None
        if index == 0:
            try:
                await self._acquire(owner)
            except RuntimeError as exc:
                if staged is not None:
                    self.engine.submit(self.engine.discard_staged, staged)
                if order is not None:
                    order.fail(index, str(exc))
                    await order.pass_turn(index)
                raise
        try:
            future = self.engine.submit(_timed, fn, order, index, *args)
        finally:
            if order is not None:
                await order.pass_turn(index)
        return await future

    async def _skip_turn(self, order: PushOrder, index: int) -> None:
        """A request that failed before it was queued still passes its turn (in order), so the next can go."""
        with contextlib.suppress(TimeoutError, ValueError):
            await order.wait_turn(index, TURN_TIMEOUT_S)
        await order.pass_turn(index)

    def _discard(self, future: asyncio.Future) -> None:
        """The staged update of a handler that went away, released on the engine thread."""
        if not future.cancelled() and future.exception() is None:
            self.engine.submit(self.engine.discard_staged, future.result())

    def _apply(self, order: PushOrder | None, index: int, staged: StagedUpdate,
               flush_cache: bool, push: PushPosition | None, version: str | None) -> int:
        """Engine thread: the staged copy, unless an earlier request of its push failed."""
        refusal = order.refusal(index) if order is not None else None
        if refusal is not None:
            self.engine.discard_staged(staged)
            raise RuntimeError(refusal)
        return _failing(order, index, self.engine.push_staged, staged, flush_cache, push, version)

    def _unstaged(self, order: PushOrder | None, index: int, serialized: Any, load_format: str | None,
                  flush_cache: bool, push: PushPosition | None, version: str | None) -> int:
        """Engine thread: the whole request there (none other in flight; tensor parallel; malformed entries get
        their error)."""
        refusal = order.refusal(index) if order is not None else None
        if refusal is not None:
            raise RuntimeError(refusal)
        return _failing(order, index, self.engine.push_unstaged, serialized, load_format, flush_cache, push, version)


def _failing(order: PushOrder | None, index: int, fn: Callable[..., int], *args: Any) -> int:
    """`fn(*args)`; when it raises, the push fails from request `index` on."""
    try:
        return fn(*args)
    except Exception as exc:
        if order is not None:
            order.fail(index, f"{type(exc).__name__}: {exc}")
        raise


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, dict[str, float]]:
    """`fn(*args)` in the engine thread, with the seconds of each phase it marked (`phase_times`)."""
    with phase_times.collect() as timings:
        result = fn(*args)
    return result, timings


def _merged(stage: dict[str, float], engine: dict[str, float]) -> dict[str, float]:
    """The engine thread's phases (`total`: its seconds) and the staging thread's, as `stage_<phase>` (`stage`:
    its seconds, the wait for a sleep or wake in progress included)."""
    merged = dict(engine)
    for name, seconds in stage.items():
        merged["stage" if name == "total" else f"stage_{name}"] = seconds
    return merged

