"""`MemoryManager`: tagged, address-stable memory that sleeps and wakes."""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import traceback
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from torpor.memory import checkpoint, host_buffer
from torpor.memory.checkpoint import CheckpointReport, CheckpointUnsupportedError, ContextCheckpointedError
from torpor.memory.host_buffer import HOST_BACKUPS
from torpor.memory.types import (
    Action,
    AuditReport,
    LateAllocation,
    Report,
    TagAsleepError,
    TagState,
    TagUsage,
)


class MemoryManager:
    """Tagged memory on one device (`"cuda:N"` or `"cpu"`) that can sleep and wake.

    Tensors allocated inside `with mm.tag(name):` live in that tag's memory. `sleep` releases
    the memory of the tags it names (offload: copy to host first; discard: no copy), `wake`
    brings it back at the same addresses. Several managers may exist per process and per
    device; each is thread-safe.

    Args:
        device: "cuda", "cuda:N" or "cpu".
        host_backup: "pinned" (fast, reused page-locked buffers) or "pageable" (no pinned
            memory; slower copies). CUDA only.
        max_host_bytes: cap on the host memory held for offloaded copies; a sleep that would
            exceed it raises HostMemoryError and leaves everything awake.
        backup_dir: CPU only: where offloaded bytes are written (default: the temp directory).
        wake_piece_mib: CUDA only: a segment woken without a copy (discarded, zero-filled) is mapped in
            pieces of this many MiB, so its refill starts before the whole segment is mapped (0: whole);
            64 measured best on an H200 (docs/benchmarks.md).
    """

    def __init__(self, device: str | torch.device = "cuda", *, host_backup: str = "pinned",
                 max_host_bytes: int | None = None, backup_dir: str | None = None,
                 wake_piece_mib: int = 64) -> None:
        device = torch.device(device)
        if host_backup not in HOST_BACKUPS:
            raise ValueError(f"host_backup must be one of {HOST_BACKUPS}, got {host_backup!r}")
        if isinstance(wake_piece_mib, bool) or not isinstance(wake_piece_mib, int) or wake_piece_mib < 0:
            raise ValueError(f"wake_piece_mib must be an int >= 0, got {wake_piece_mib!r}")
        close_deferred()  # managers collected on a torpor thread since (see __del__)
        self._lock = threading.RLock()  # serializes sleep, wake and tag-state changes
        self._scope_guard: contextlib.AbstractContextManager = contextlib.nullcontext()
        self._local = threading.local()  # per thread: stack of active tag names
        self._states: dict[str, TagState] = {}
        self._actions: dict[str, Action] = {}  # action of the last sleep of each asleep tag
        self._active = Counter()  # tag -> number of open scopes, all threads
        self._sealed: set[str] = set()
        self._late: list[LateAllocation] = []
        self._clean: set[str] = set()  # awake tags whose owner declared them unwritten since their wake
        self._last_allocated: dict[str, int] = {}  # per tag, for readings while the context is checkpointed
        self._last_device_used: int | None = None
        self._reservation: HostReservation | None = None
        hook = _weak_hook(self)  # backends must not keep the manager alive
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"MemoryManager({str(device)!r}): CUDA is not available here; use 'cpu'")
        if device.type == "cuda":
            from torpor.memory.cuda_backend import ALLOCATION_LOCK, CudaBackend  # cuda-bindings: CUDA only

            index = device.index if device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
            self._backend = CudaBackend(index, host_backup, max_host_bytes, hook, wake_piece_mib << 20)
            # See cuda_backend: scopes and every call that takes PyTorch's allocator lock while
            # holding the GIL are serialized process-wide, so they never meet a callback.
            self._lock = self._scope_guard = ALLOCATION_LOCK
        elif device.type == "cpu":
            from torpor.memory.host_backend import HostBackend  # the CPU backend's dispatch mode: CPU managers only

            self.device = device
            self._backend = HostBackend(max_host_bytes, backup_dir, on_new_segment=hook)
        else:
            raise ValueError(f"unsupported device {device}; torpor.memory supports 'cuda' and 'cpu'")

    def close(self) -> None:
        """Let go of the tags' pools. Their memory returns to the device once their tensors are
        gone (CUDA: and `torch.cuda.empty_cache()` ran). Also done when the manager is collected."""
        close_deferred()  # (a nested call finds the list empty)
        if getattr(self, "_reservation", None) is not None:
            self._stop_reservation()  # it pins into the backend about to close
        backend = getattr(self, "_backend", None)
        if backend is not None and not self.is_context_checkpointed():  # no CUDA call while checkpointed
            with self._lock:
                backend.close()

    def __del__(self) -> None:
        if threading.current_thread().name.startswith("torpor-"):
            # Collected on one of torpor's background threads (the cyclic collector runs wherever Python allocates):
            # freeing the pools there could deadlock with the owner's allocator calls (docs/memory.md, "Threads").
            # Kept alive until the next manager is made or closed, which closes it on that thread.
            with _DEFERRED_LOCK:
                _DEFERRED.append(self)
            return
        self.close()

    def __repr__(self) -> str:
        return f"MemoryManager({str(self.device)!r}, tags={sorted(self._states)})"

    # ---- scopes ------------------------------------------------------------------------
    @contextlib.contextmanager
    def tag(self, name: str) -> Iterator[None]:
        """Allocate everything created in this scope (this thread) in tag `name`. Scopes nest;
        the innermost tag wins. Entering the scope of a sleeping tag raises TagAsleepError."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tag name must be a non-empty string, got {name!r}")
        with self._scope_guard:
            yield from self._scope(name)

    def _scope(self, name: str) -> Iterator[None]:
        self._check_context("a tag scope")
        with self._lock:
            self._awake_tag(name)
            self._active[name] += 1
            self._mark_dirty(name)  # allocating in a tag writes it
        stack = self._stack()
        parent = stack[-1] if stack else None
        watch = self._watch(name)
        self._backend.enter_scope(name, parent)
        stack.append(name)
        try:
            yield
        finally:
            stack.pop()
            self._backend.exit_scope(name, parent)
            with self._lock:
                self._active[name] -= 1
            if watch is not None:
                self._record_growth(name, *watch)

    @contextlib.contextmanager
    def graph_pool(self, name: str) -> Iterator[tuple[int, int]]:
        """CUDA: the memory pool of tag `name`, for capturing a CUDA graph whose private memory
        lives in the tag (it then sleeps and wakes with it):

            with mm.graph_pool("cuda_graph") as pool, torch.cuda.graph(g, pool=pool):
                out = model(static_input)

        Holds the allocation lock during the capture, like a tag scope (see cuda_backend)."""
        if self.device.type != "cuda":
            raise ValueError("graph_pool exists only for CUDA managers")
        self._check_context("graph_pool")
        with self._scope_guard, self._lock:
            self._awake_tag(name)
            yield self._backend.pool_id(name)

    def _awake_tag(self, name: str) -> None:
        """Create tag `name` if new; refuse if it sleeps. Called with the lock held."""
        if name not in self._states:
            self._backend.create_tag(name)
            self._states[name] = TagState.AWAKE
        if self._states[name] is TagState.ASLEEP:
            raise TagAsleepError(f"tag {name!r} is asleep: wake it before allocating in it")

    def _stack(self) -> list[str]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    # ---- sleep / wake ------------------------------------------------------------------
    def sleep(self, actions: Mapping[str, str | Action]) -> Report:
        """Put the named tags to sleep: `{"weights": "offload", "kv_cache": "discard"}`.

        Tags not named stay awake; `keep` keeps a tag awake; a tag already asleep is left as it
        is, except that `discard` on an offloaded tag drops its host copy. All or nothing: if
        host memory for the copies is missing, HostMemoryError is raised and every tag stays
        awake."""
        plan = self._plan(actions)
        self._check_context("sleep")
        self._stop_reservation()  # the sleep takes over what the background reservation has not done
        start = time.perf_counter()
        with self._lock, self._on_device():
            todo = self._awake_plan(plan)
            for tag, action in plan.items():
                if (action is Action.DISCARD and self._states[tag] is TagState.ASLEEP
                        and self._actions[tag] is Action.OFFLOAD):
                    self._backend.drop_copies(tag)
                    self._actions[tag] = Action.DISCARD
            reports = self._backend.sleep(todo, self._clean) if todo else []
            for tag, action in todo.items():
                self._states[tag] = TagState.ASLEEP
                self._actions[tag] = action
                self._clean.discard(tag)
        return Report("sleep", tuple(reports), time.perf_counter() - start)

    def check_sleep(self, actions: Mapping[str, str | Action]) -> None:
        """Raise, touching nothing, what `sleep(actions)` would raise that can be known beforehand: an
        unknown tag or action, an open tag scope, host copies beyond `max_host_bytes` (HostMemoryError). A
        caller that must undo work if the sleep fails (the engine aborting requests) checks first."""
        plan = self._plan(actions)
        self._check_context("sleep")
        with self._lock:
            self._backend.check_sleep(self._awake_plan(plan), self._clean)

    def _plan(self, actions: Mapping[str, str | Action]) -> dict[str, Action]:
        if not isinstance(actions, Mapping):
            raise TypeError(f"sleep takes a mapping of tag to action, e.g. {{'weights': 'offload'}}; got {actions!r}")
        return {self._check_tag(tag): Action.parse(action) for tag, action in actions.items()}

    def _awake_plan(self, plan: dict[str, Action]) -> dict[str, Action]:
        """The actions of `plan` on awake tags (what a sleep releases); refuses tags with an open scope.
        Called with the lock held."""
        busy = [t for t in plan if self._active[t] and plan[t] is not Action.KEEP]
        if busy:
            raise RuntimeError(f"cannot sleep tags {busy}: a `tag` scope is open on them")
        return {t: a for t, a in plan.items() if a is not Action.KEEP and self._states[t] is TagState.AWAKE}

    def wake(self, tags: Iterable[str] | str | None = None) -> Report:
        """Wake the named tags (one name, or all sleeping tags when None). Offloaded memory comes back
        byte-identical, discarded memory zero-filled, both at the same addresses. If the device
        has no room, WakeError is raised, nothing stays half-mapped and the call can be retried.
        If this process's CUDA context is checkpointed (`checkpoint_context`), it is restored first."""
        start = time.perf_counter()
        self.restore_context()
        with self._lock, self._on_device():
            names = list(self._states) if tags is None else self._check_tags(tags)
            plan = {t: self._actions[t] for t in names if self._states[t] is TagState.ASLEEP}
            reports = self._backend.wake(plan) if plan else []
            for tag in plan:
                self._states[tag] = TagState.AWAKE
                del self._actions[tag]
        return Report("wake", tuple(reports), time.perf_counter() - start)

    def reserve_host(self, tags: Iterable[str] | str) -> int:
        """Allocate now the host buffers (pinned on CUDA) that offloading `tags` will need, so the
        first sleep runs at the host link's speed instead of paying for pinning (~0.5 s/GiB). Returns
        the bytes reserved; raises HostMemoryError (nothing kept) when the host cannot hold them."""
        names = self._check_tags(tags)
        self._check_context("reserve_host")
        with self._lock, self._on_device():
            return self._backend.reserve(names)

    def reserve_host_in_background(self, tags: Iterable[str] | str,
                                   on_done: Callable[[HostReservation], None] | None = None) -> HostReservation:
        """`reserve_host(tags)` on a background thread, one segment at a time, so that start-up does not
        wait for it and a `sleep` never waits for more than one segment: a sleep stops the reservation and
        makes what is missing itself. Returns a handle (`wait()`, `reserved_bytes`, `error`); `on_done(handle)`
        runs on the background thread when it ends (not when a sleep stopped it)."""
        names = self._check_tags(tags)
        self._stop_reservation()
        self._reservation = HostReservation(self, names, on_done)
        return self._reservation

    def _stop_reservation(self) -> None:
        if self._reservation is not None:
            self._reservation.stop()

    # ---- clean host copies ---------------------------------------------------------------
    def mark_clean(self, tag: str) -> int:
        """Declare that nothing has written awake tag `tag` since it woke from its host copy, and that
        every later write will be declared with `mark_dirty(tag)` first. Its next offload then keeps that
        copy and only releases device memory (no copy). Returns the bytes whose copy is kept (0 when the
        tag did not wake from a copy, e.g. it was discarded). TORPOR_VERIFY_CLEAN_COPIES=1 checks the
        declaration with checksums at the sleep (StaleCopyError)."""
        with self._lock:
            self._check_tag(tag)
            if self._states[tag] is TagState.ASLEEP:
                raise ValueError(f"tag {tag!r} is asleep: mark_clean declares an awake tag unwritten")
            self._clean.add(tag)
            return self._backend.current_copy_bytes(tag)

    def is_clean(self, tag: str) -> bool:
        """Whether awake `tag` is marked clean and its host copy holds every byte of it (a wake from the copy, or
        `snapshot`): `revert` can then put those bytes back after a write."""
        with self._lock:
            return (self._states[self._check_tag(tag)] is TagState.AWAKE and tag in self._clean
                    and self._backend.copy_is_current(tag))

    def snapshot(self, tag: str) -> int:
        """Copy awake `tag` into its host copy (made first, reused after; as an offload copies it, but the device
        memory stays) and mark it clean: a later write can be undone with `revert`, and the next offload keeps the
        copy. All or nothing: without host memory for the copy, HostMemoryError and nothing changed. Returns the
        bytes copied (0 when the copy was current already)."""
        self._check_context("snapshot")
        with self._lock, self._on_device():
            if self._states[self._check_tag(tag)] is not TagState.AWAKE:
                raise ValueError(f"tag {tag!r} is asleep: only an awake tag has device bytes to copy")
            if tag in self._clean and self._backend.copy_is_current(tag):
                return 0
            copied = self._backend.snapshot(tag)
            self._clean.add(tag)
            return copied

    def revert(self, tag: str) -> int:
        """Undo the writes to awake `tag` since it was clean: its host copy (from the wake or `snapshot` before
        the writes began, kept since) is copied back over the device bytes, at the same addresses; the tag is clean
        again. The caller must have declared the writes (`mark_dirty`) and must not have slept the tag meanwhile
        (a sleep copies the written bytes over the old ones). Returns the bytes copied."""
        self._check_context("revert")
        with self._lock, self._on_device():
            if self._states[self._check_tag(tag)] is not TagState.AWAKE:
                raise ValueError(f"tag {tag!r} is asleep: revert puts back the bytes of an awake tag")
            copied = self._backend.revert(tag)
            self._clean.add(tag)
            return copied

    def mark_dirty(self, tag: str) -> None:
        """Declare a write to `tag` (or one about to happen): its next offload copies it again. Every path
        that writes a tag marked clean must call this (a tag scope does it itself)."""
        with self._lock:
            self._mark_dirty(self._check_tag(tag))

    def _mark_dirty(self, tag: str) -> None:
        self._clean.discard(tag)
        self._backend.mark_dirty(tag)

    # ---- the CUDA context (level 3) --------------------------------------------------------
    def check_checkpoint(self) -> None:
        """Raise CheckpointUnsupportedError, touching nothing, when `checkpoint_context` cannot work here."""
        with self._lock:
            self._check_checkpointable()
            checkpoint.check_support(self._backend.pci_bus_id())

    def checkpoint_context(self, lock_timeout_s: float = 10.0, timeout_s: float = 300.0) -> CheckpointReport:
        """Release this process's whole CUDA context through the driver's checkpoint API (see
        torpor.memory.checkpoint): the process then holds no device memory. Sleep the tags first (the
        driver copies at ~2 GB/s, tags move at link speed). Preconditions, checked before anything is
        touched, raise CheckpointUnsupportedError: a CUDA manager, the driver API present (driver >= 570,
        cuda-bindings), no tag scope open. Until `restore_context` (or `wake`) nothing in the process may
        make a CUDA call; this manager's readings answer from known state. A failed checkpoint raises
        CheckpointError with the process running as before."""
        self._stop_reservation()  # before the lock: the reservation's thread takes it per segment
        with self._lock:
            self.check_checkpoint()
            self.usage()  # refresh the readings given while checkpointed
            self._last_device_used = self._backend.device_used_bytes()
            self._backend.quiesce()
            return checkpoint.checkpoint_process(lock_timeout_s=lock_timeout_s, timeout_s=timeout_s)

    def restore_context(self, timeout_s: float = 300.0) -> CheckpointReport | None:
        """Restore this process's checkpointed CUDA context (None when it is not checkpointed). The device
        must have the memory the checkpoint held: if not, CheckpointError and it stays checkpointed."""
        if not checkpoint.is_checkpointed():
            return None
        with self._lock:
            return checkpoint.restore_process(timeout_s)

    def is_context_checkpointed(self) -> bool:
        """Whether this process's CUDA context is checkpointed (a local flag: no CUDA call)."""
        if self.device.type != "cuda":
            return False
        return checkpoint.is_checkpointed()

    def _check_checkpointable(self) -> None:
        if self.device.type != "cuda":
            raise CheckpointUnsupportedError(
                f"checkpoint_context releases a CUDA context; this manager is on {self.device}, which has none")
        scopes = sorted(t for t, n in self._active.items() if n)
        if scopes:
            raise CheckpointUnsupportedError(f"cannot checkpoint the CUDA context: tag scopes are open on {scopes}")

    def _check_context(self, what: str) -> None:
        if self.is_context_checkpointed():
            raise ContextCheckpointedError(f"{what}: this process's CUDA context is checkpointed; call "
                                           "restore_context() (or wake()) first")

    def is_sleeping(self, tag: str | None = None) -> bool:
        """Whether `tag` sleeps; with no tag, whether any tag sleeps."""
        with self._lock:
            if tag is None:
                return any(s is TagState.ASLEEP for s in self._states.values())
            return self._states[self._check_tag(tag)] is TagState.ASLEEP

    def _check_tags(self, tags: Iterable[str]) -> list[str]:
        """Known tags; one name alone stands for itself (`wake("weights")`), not for its letters."""
        return [self._check_tag(tags)] if isinstance(tags, str) else [self._check_tag(t) for t in tags]

    def _check_tag(self, tag: str) -> str:
        if tag not in self._states:
            known = ", ".join(sorted(self._states)) or "none yet"
            raise ValueError(f"unknown tag {tag!r} (known tags: {known})")
        return tag

    def _on_device(self) -> contextlib.AbstractContextManager:
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    # ---- readings ----------------------------------------------------------------------
    def tags(self) -> list[str]:
        with self._lock:
            return list(self._states)

    def usage(self) -> dict[str, TagUsage]:
        """Per tag: state, reserved / resident / offloaded / discarded / allocated bytes."""
        with self._lock:
            if self.is_context_checkpointed():  # no CUDA call: the last known allocations
                allocated = self._last_allocated
            else:
                allocated, _ = self._backend.allocated_bytes()
                self._last_allocated = allocated
            return {tag: self._usage_of(tag, allocated.get(tag, 0)) for tag in self._states}

    def _usage_of(self, tag: str, allocated: int) -> TagUsage:
        segs = self._backend.of_tag(tag)
        reserved = sum(s.size for s in segs)
        resident = sum(s.size for s in segs if s.resident)
        offloaded = sum(s.size for s in segs if not s.resident and s.holds_copy)
        backup = sum(self._backend.backup_size(s) for s in segs if s.backup is not None)
        return TagUsage(tag, self._states[tag], reserved, resident, offloaded,
                        reserved - resident - offloaded, allocated, backup, len(segs), tag in self._sealed)

    def device_used_bytes(self) -> int:
        """Device memory in use on the manager's device (CPU: this process's RSS). While the context is
        checkpointed: NVML's reading taken by the checkpoint helper, else the last known value."""
        if self.is_context_checkpointed():
            try:
                return checkpoint.device_readings().get("used_bytes", self._last_device_used)
            except checkpoint.CheckpointError:
                return self._last_device_used
        self._last_device_used = self._backend.device_used_bytes()
        return self._last_device_used

    # ---- audit -------------------------------------------------------------------------
    def seal(self, tag: str) -> None:
        """Declare `tag` complete: any later allocation into it is reported by `audit()` with the
        Python stack that made it."""
        with self._lock:
            self._sealed.add(self._check_tag(tag))

    def audit(self) -> AuditReport:
        """Memory outside every tag, and allocations made into sealed tags."""
        self._check_context("audit")
        with self._lock:
            _, untagged = self._backend.allocated_bytes()
            used = self._backend.device_used_bytes()
            tagged = sum(s.size for s in self._backend.segments.values() if s.resident)
            late = tuple(self._late)
        other = None if used is None else max(used - tagged - untagged, 0)
        return AuditReport(used, tagged, untagged, other, late)

    def _watch(self, tag: str) -> tuple[int, str] | None:
        if tag not in self._sealed:
            return None
        allocated, _ = self._backend.allocated_bytes()
        return allocated.get(tag, 0), "".join(traceback.format_stack(limit=12)[:-3])

    def _record_growth(self, tag: str, before: int, where: str) -> None:
        allocated, _ = self._backend.allocated_bytes()
        grown = allocated.get(tag, 0) - before
        if grown > 0:
            with self._lock:
                self._late.append(LateAllocation(tag, grown, where))

    def _on_new_segment(self, tag: str, size: int) -> None:
        """Backend hook: a new segment was made in `tag` outside this thread's scope of it
        (e.g. a CUDA graph capturing into the tag's pool) after the tag was sealed."""
        if tag in self._sealed and tag not in self._stack():
            where = "".join(traceback.format_stack(limit=12)[:-3])
            self._late.append(LateAllocation(tag, size, where))


class HostReservation:
    """A background `reserve_host`: one segment at a time (on CUDA pinned outside the manager's and the
    store's locks, so the engine's work beside it never waits for a pin), so a sleep waits for one segment
    at most and then makes the missing copies itself (`stop()` ends it after the segment
    in progress). `reserved_bytes` counts the host bytes made; `error` holds a HostMemoryError that ended it
    early (what was reserved stays: it is used by the sleep)."""

    def __init__(self, manager: MemoryManager, tags: list[str],
                 on_done: Callable[[HostReservation], None] | None = None) -> None:
        self.tags = tags
        self._on_done = on_done
        self.reserved_bytes = 0
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._stop = threading.Event()
        # The backend and the device, not the manager: a strong reference to the manager here could be the last
        # one, and the manager would then close on this thread — its pools' segments freed through the allocator
        # callbacks while the owner's thread may be in the allocator (the GIL / allocator-mutex deadlock of
        # docs/memory.md, "Threads"; hit in tests/gpu/test_engine.py). The manager's close stops this first.
        self._backend = manager._backend
        self._device = manager.device
        self._thread = threading.Thread(target=self._run, name="torpor-reserve-host", daemon=True)
        _RESERVATIONS.add(self)
        self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            if self._device.type == "cuda":
                # A new thread has no current CUDA context; pinning host memory is a driver call that needs one.
                from torpor.memory.cuda_driver import make_primary_context_current

                make_primary_context_current(self._device.index)
            while not self._stop.is_set():
                with host_buffer.in_background():  # a few threads pin: the start-up beside keeps the cores
                    made = self._reserve_one()
                if made is None:
                    break
                self.reserved_bytes += made
        except BaseException as exc:  # reported through `error`; the sleep reserves what is missing
            self.error = exc
        self.seconds = time.perf_counter() - start
        if self._on_done is not None and not self._stop.is_set():
            self._on_done(self)

    def _reserve_one(self) -> int | None:
        """Reserve the host copy of the next segment of the tags that has none; None when none is left.
        Not under the manager's lock: every tag scope takes it, and pinning a segment takes ~0.2 s per GiB (a
        first request waited for whole segments: start-up +12% on an H200). The store locks what it reads and
        attaches; a sleep, a checkpoint or the manager's close stops this thread (and waits for the segment in
        progress) first."""
        if self._device.type == "cuda":
            if checkpoint.is_checkpointed():
                return None
            with torch.cuda.device(self._device):
                return self._backend.reserve_one(self.tags)
        return self._backend.reserve_one(self.tags)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the reservation to end; whether it has."""
        self._thread.join(timeout)
        return self.done

    def stop(self) -> None:
        """End it after the segment in progress, and wait for that."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()


_DEFERRED: list[MemoryManager] = []  # collected on a torpor thread, to close on another (MemoryManager.__del__)
_DEFERRED_LOCK = threading.Lock()


def close_deferred() -> int:
    """Close the managers collected on torpor's background threads since the last call (on this thread); the
    count. Making or closing any manager calls it; call it yourself after dropping engines without `close()`."""
    with _DEFERRED_LOCK:
        managers = _DEFERRED[:]
        _DEFERRED.clear()
    for manager in managers:
        manager.close()
    return len(managers)


_RESERVATIONS: weakref.WeakSet[HostReservation] = weakref.WeakSet()


@atexit.register
def _stop_reservations() -> None:
    """A reservation must not be pinning memory while the interpreter (and the CUDA context) shut down."""
    for reservation in list(_RESERVATIONS):
        reservation.stop()


def _weak_hook(manager: MemoryManager):
    ref = weakref.ref(manager)

    def hook(tag: str, size: int) -> None:
        target = ref()
        if target is not None:
            target._on_new_segment(tag, size)

    return hook
