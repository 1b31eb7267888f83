"""`WeightReceiver`: every write to an engine's weights — a reload, an in-process update, a trainer's push of
tensors by reference, a distributed update — goes through `write`, which keeps the one rule: the engine never
serves a mix of old and new weights.

- Every request is checked whole (names, shapes, dtypes against the checkpoint's manifest, finite values) before
  any byte of it is written.
- A push of several requests (torpor's push headers: `PushPosition`; the four-phase update) is one update: from
  its first write until its last request commits, nothing runs (`Lifecycle.begin_update`), so no step sees part of
  it. If it fails after writing began — a request refused, a sleep, the trainer gone quiet — the old weights come
  back from their host copy when it was current at the start (a level-1 sleep and wake leave one: the RL order),
  else the weights count as not whole, naming the tensors the push did not write, until a complete update or a
  reload.
- A reload of whole weights whose host copy is not current copies them to the host first (`snapshot`), so a
  checkpoint that fails midway (a NaN found after the copy) is undone.
- After a level-2 sleep the weights are whole once every tensor came, over any number of updates
  (`Lifecycle.weights_written` counts them down); the RoPE table is recomputed then, once.

The receiver also opens and checks a push's payloads off the engine thread (`stage`: the server's pipeline, at
TP=1) and keeps a trainer's reused buffers mapped through its push (`keeping`). Its collaborators are explicit:
the engine's executor (every rank), its lifecycle, and `on_change` (called after every committed write: the
engine forgets its prefix cache).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from torpor.engine import phase_times
from torpor.engine.engine_stream import EngineStream
from torpor.engine.executor.base import Executor
from torpor.engine.lifecycle import Lifecycle, LifecycleError
from torpor.engine.phase_times import phase
from torpor.engine.weights.index import CheckpointError
from torpor.engine.weights.loader import check_staged
from torpor.engine.weights.manifest import Manifest
from torpor.engine.weights.payload import named_tensors_of, unpickle_payload
from torpor.engine.weights.transport import check_timeout
from torpor.engine.weights.updates import OPENED, release_transfer_memory, specs_of

MAX_WEIGHT_VALUES = 1 << 24  # get_weights_by_name's answer, at most (a JSON list of floats)
logger = logging.getLogger("torpor.engine")
MAX_ENDED = 64  # ended pushes remembered (a late request of one is refused, not taken for a new push)


@dataclass(frozen=True)
class PushPosition:
    """Where a request stands in its push (torpor's headers): `index` 0, 1, ...; `last` on its last request;
    `keep`: how many buffers the trainer cycles its buckets through (their mappings are kept until `last`)."""

    push_id: str
    index: int
    keep: int = 0
    last: bool = False


@dataclass(eq=False)
class StagedUpdate:
    """One request's tensors, opened and checked off the engine thread, waiting for their copy: `ready` is a CUDA
    event recorded after they were opened (None on CPU), `timings` the staging thread's phases, `dropped` why the
    copy will not happen (a sleep came first)."""

    pairs: list[tuple[str, torch.Tensor]]
    ready: object | None
    timings: dict[str, float]
    dropped: str | None = None


@dataclass
class _Update:
    """The update in progress: its id, whether a failure can be undone (a current host copy at its start), what
    it wrote so far."""

    update_id: str
    revertible: bool
    written: set[str] = field(default_factory=set)


class WeightReceiver:
    def __init__(self, executor: Executor, lifecycle: Lifecycle, manifest: Manifest, ignored: Callable[[str], bool],
                 on_change: Callable[[], None]) -> None:
        self.executor, self.lifecycle, self.manifest = executor, lifecycle, manifest
        self.ignored, self.on_change = ignored, on_change
        self.world_size = executor.world_size
        # Held while a payload is opened off the engine thread (`stage`) and while a sleep or wake changes the
        # memory (`held`): no IPC handle is opened during a context checkpoint or restore.
        self.gate = threading.Lock()
        self._update: _Update | None = None
        self._ended: OrderedDict[str, str] = OrderedDict()  # push id -> why it ended without committing
        self._staged: list[StagedUpdate] = []  # opened, waiting for their copy (dropped by a sleep)
        self._staged_lock = threading.Lock()
        # Storages of a trainer's memory kept open through a push whose trainer reuses its buffers (`keeping`), by
        # push id, the most recently used last; a sleep releases them all.
        self._kept: dict[str, OrderedDict[tuple, torch.UntypedStorage]] = {}
        self._keeping: dict[tuple, torch.UntypedStorage] | None = None
        self._stage_stream: EngineStream | None = None
        self._receiving: set[str] = set()  # update groups receiving on their own threads
        # The label of the weights served (SGLang's and vLLM's weight_version): set when an update that names one
        # commits, or by `set_version`; the checkpoint's weights are "default".
        self.version = "default"

    # ---- the one write path ------------------------------------------------------------------------------
    def check_awake(self, what: str) -> None:
        if self.lifecycle.is_asleep("weights") or self.lifecycle.context_released:
            raise LifecycleError(f"{what}: the weights are asleep; call wake_up(['weights']) first (HTTP: POST "
                                 "/wake_up?tags=weights)")

    def write(self, names: Collection[str] | None, copy: Callable[[], int], push: PushPosition | None = None,
              flush_cache: bool = True, version: str | None = None) -> int:
        """Run `copy()` (checked tensors into the weights on every rank; returns a count) as part of an update:
        `push` names a multi-request one (None: this call is the whole update); `names`: the tensors it writes
        (None: every one, a reload); `version`: the weights' label once the update commits (only then). See the
        module docstring for the rule it keeps."""
        if version is not None:
            check_version(version)  # before any write: a bad label must not fail a committed update
        self.check_awake("update weights")
        lc = self.lifecycle
        update = self._join(push)
        revertible = update.revertible if update is not None else self._revertible()
        try:
            with phase("copy_all"):
                count = copy()
        except BaseException as exc:
            written = not isinstance(exc, ValueError | LifecycleError) or (
                isinstance(exc, CheckpointError) and exc.weights_written)
            if written or (update is not None and update.written):
                self._failed(update, revertible, f"{type(exc).__name__}: {exc}", written)
            elif update is not None and push is not None and push.index == 0:
                self._end(update, None)  # refused before anything was written: no update happened
            raise
        if names is None:  # a reload: every tensor
            completed = not lc.weights_whole
            lc.weights_loaded()
        else:
            if update is not None:
                update.written |= set(names)
            completed = lc.weights_written(self.manifest.covered(names))  # a fused tensor covers its parts
        if completed:
            self.executor.collective_rpc("reset_buffers")  # discarded with the weights; recomputed once, here
        if push is None or push.last:
            self._end(update, None)
            if version is not None:
                self.set_version(version)
            if flush_cache:
                self.on_change()
        return count

    def begin(self, update_id: str, what: str) -> None:
        """Begin an update that the calls to come write (`write` with `PushPosition(update_id, 1, 2, ...)`) and
        `commit` ends: from now on nothing runs until it ends (vLLM's start_weight_update)."""
        self.check_awake(what)
        self._join(PushPosition(update_id, 0))

    def commit(self, update_id: str, version: str | None = None, flush_cache: bool = True) -> None:
        """The update `update_id` is complete (vLLM's finish_weight_update): it commits, the weights serve (if
        whole), its `version` labels them, the prefix cache is forgotten. Raises LifecycleError, touching nothing,
        when it is not the update in progress (it failed, was abandoned, or never began)."""
        if version is not None:
            check_version(version)
        update = self._update
        if update is None or update.update_id != update_id:
            ended = self._ended.get(update_id)
            if ended is not None:
                raise LifecycleError(f"the weight update ended without committing ({ended}); none of it serves: "
                                     "start a new one")
            raise LifecycleError("no weight update is in progress: call start_weight_update first")
        self._end(update, None)
        if version is not None:
            self.version = version
        if flush_cache:
            self.on_change()

    def in_progress(self, update_id: str) -> bool:
        return self._update is not None and self._update.update_id == update_id

    def ended(self, update_id: str) -> str | None:
        """Why the update `update_id` ended without committing (None: it did not, or is unknown)."""
        return self._ended.get(update_id)

    def set_version(self, version: str) -> None:
        self.version = check_version(version)

    def _revertible(self) -> bool:
        """Whether a failed write can be undone: the weights are whole and their host copy current on every rank."""
        return self.lifecycle.weights_whole and all(self.executor.collective_rpc("weights_clean"))

    def _join(self, push: PushPosition | None) -> _Update | None:
        """The update this write belongs to (a push's first request begins it; nothing runs until it ends)."""
        lc = self.lifecycle
        if push is None:
            if lc.updating is not None:
                raise LifecycleError(f"weight update {lc.updating!r} is in progress; this update must wait for it "
                                     "to end")
            return None
        if push.push_id in self._ended:
            raise LifecycleError(f"push {push.push_id!r} ended without committing ({self._ended[push.push_id]}); "
                                 "nothing of this request was written: push again")
        if self._update is not None and self._update.update_id == push.push_id:
            return self._update
        if push.index != 0:
            raise LifecycleError(f"request {push.index} of push {push.push_id!r} came, but the push is not in "
                                 "progress (its first request did not arrive or failed); nothing was written")
        lc.begin_update(push.push_id)  # raises while another update is in progress
        self._update = _Update(push.push_id, self._revertible())
        return self._update

    def _failed(self, update: _Update | None, revertible: bool, reason: str, written: bool) -> None:
        """A write failed after writing began: put the old weights back, or record a mix (never served)."""
        wrote = set() if update is None else set(update.written)
        if revertible:
            try:
                with phase("revert"):
                    self.executor.collective_rpc("revert_weights")
                logger.warning("weight update failed (%s); the previous weights were put back from their host copy",
                               reason)
            except Exception as exc:
                logger.error("weight update failed (%s) and putting the previous weights back failed too: %s",
                             reason, exc)
                self.lifecycle.weights_mixed(wrote if not written else ())
        elif self.lifecycle.weights_whole:
            self.lifecycle.weights_mixed(wrote if not written else ())
            logger.warning("weight update failed (%s) after writing part of the weights; the engine serves again "
                           "after a reload or a complete update (%d tensors missing)", reason,
                           len(self.lifecycle.missing))
        self._end(update, reason)

    def _end(self, update: _Update | None, failure: str | None) -> None:
        if update is None:
            return
        if self._update is update:
            self._update = None
        if failure is not None:
            self._ended[update.update_id] = failure
            while len(self._ended) > MAX_ENDED:
                self._ended.popitem(last=False)
        self.lifecycle.end_update(update.update_id)
        self.forget(update.update_id)

    def abandon(self, push_id: str | None, reason: str) -> bool:
        """End the update in progress (`push_id`, or whichever) that will not commit — its trainer went quiet, a
        sleep came — as a failure. Returns whether one was in progress."""
        update = self._update
        if update is None or (push_id is not None and update.update_id != push_id):
            self.forget(push_id)
            return False
        if update.written:
            self._failed(update, update.revertible, reason, written=False)
        else:
            self._end(update, reason)
        return True

    def reload(self, path: str, version: str | None = None, flush_cache: bool = True) -> None:
        """The checkpoint at `path` into the weights of every rank. Whole weights whose host copy is not current
        are copied to the host first, so a checkpoint that fails midway (a non-finite value is found after its
        copy) is undone; without host memory for that copy a failure leaves them not whole (never served)."""
        if self.lifecycle.weights_whole and self.lifecycle.updating is None and not self._revertible():
            try:
                with phase("snapshot"):
                    self.executor.collective_rpc("snapshot_weights")
            except Exception as exc:  # e.g. HostMemoryError: the reload goes on, a failure then cannot be undone
                logger.warning("reload_weights: no host copy of the weights could be made (%s); a reload that "
                               "fails midway leaves them not whole", exc)
        def copy() -> int:
            self.executor.collective_rpc("reload_weights", (path,))
            return 0

        self.write(None, copy, flush_cache=flush_cache, version=version)

    # ---- in-process and payload updates ----------------------------------------------------------------------
    def update_weights(self, named_tensors, push: PushPosition | None = None, staged: bool = False,
                       flush_cache: bool = True, version: str | None = None) -> int:
        """`(name, tensor)` pairs (a list: checked whole first; any other iterable: a stream, checked tensor by
        tensor) into the weights of every rank."""
        if isinstance(named_tensors, list | tuple):
            with phase("check"):
                self.manifest.check(named_tensors)
            names: Collection[str] | None = [name for name, _ in named_tensors]
            return self.write(names, lambda: self.executor.load_weights(named_tensors, False, False, staged), push,
                              flush_cache, version)
        seen: list[str] = []  # filled by the copy, before `write` counts the names

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named_tensors:
                seen.append(name)
                yield name, tensor

        return self.write(seen, lambda: self.executor.load_weights(stream(), False, False), push, flush_cache,
                          version)

    def update_from_tensor(self, serialized: Sequence[str] | None = None, load_format: str | None = None,
                           flush_cache: bool = True, named_tensors=None, push: PushPosition | None = None,
                           version: str | None = None) -> int:
        """SGLang's update_weights_from_tensor: base64 payloads (one entry, or one per rank), or in-process the
        named tensors themselves (pairs, or a flattened-bucket dict with load_format "flattened_bucket")."""
        self.check_awake("update_weights_from_tensor")  # before any handle is opened
        if (serialized is None) == (named_tensors is None):
            raise ValueError("give exactly one of serialized_named_tensors and named_tensors")
        if not isinstance(flush_cache, bool):
            raise ValueError(f"flush_cache must be true or false, got {flush_cache!r}")
        if named_tensors is not None:
            with phase("decode"):
                pairs = named_tensors_of(named_tensors if load_format else list(named_tensors), load_format)
        elif self.world_size > 1 and isinstance(serialized, list | tuple) and len(serialized) == self.world_size:
            return self._per_rank(list(serialized), load_format, flush_cache, push, version)
        else:
            pairs = self.decode(serialized, load_format)
        try:
            return self.update_weights(pairs, push, flush_cache=flush_cache, version=version)
        finally:
            self._release(pairs)

    def decode(self, serialized: Sequence[str], load_format: str | None) -> list[tuple[str, torch.Tensor]]:
        """One base64 payload -> named tensors (checked against the manifest before anything is written)."""
        if not isinstance(serialized, list | tuple) or len(serialized) not in (1, self.world_size):
            raise ValueError(f"serialized_named_tensors must be a list of 1 or tensor_parallel_size "
                             f"({self.world_size}) base64 strings, got {_describe(serialized)}")
        with phase("decode"):
            payload = unpickle_payload(serialized[0], self.manifest.max_bytes)
            with phase("views"):
                pairs = named_tensors_of(payload, load_format)
            del payload
        return pairs

    def _per_rank(self, serialized: list[str], load_format: str | None, flush_cache: bool,
                  push: PushPosition | None, version: str | None = None) -> int:
        """One payload per rank: every rank opens its own entry and checks it; only when every rank holds a checked
        bucket do they all copy."""
        try:
            names = self.executor.collective_rpc("open_payload", (serialized, load_format))[0]
        except BaseException:
            self.executor.collective_rpc("drop_staged", (OPENED,))
            raise
        return self.write(names, lambda: self.executor.collective_rpc("apply_staged", (OPENED,))[0], push,
                          flush_cache, version)

    # ---- a push in flight: opened and checked off the engine thread, copied on it ------------------------------
    def stage(self, serialized: Sequence[str], load_format: str | None) -> StagedUpdate:
        """Any thread but the engine's (TP=1): open one request's payload and check it — the weights awake, every
        name / shape / dtype against the manifest and the model (the meta dry run), the finite values — while the
        engine thread copies the previous one. CUDA tensors are opened on this thread's stream; the staged update
        carries an event recorded after them, which the engine's stream waits for before reading them."""
        driver = self.executor.driver
        with phase_times.collect() as timings, self.gate:
            self.check_awake("update_weights_from_tensor")
            with self._staging_stream(driver.device):
                pairs = self.decode(serialized, load_format)
                try:
                    with phase("check"):
                        self.manifest.check(pairs)
                    check_staged(driver.runner.model, pairs)
                    staged = StagedUpdate(pairs, _ready_event(driver.device), timings)
                except BaseException:
                    release_transfer_memory(pairs)
                    raise
            with self._staged_lock:
                self._staged.append(staged)
        return staged

    def _staging_stream(self, device: torch.device) -> contextlib.AbstractContextManager:
        """CUDA: the engine's device and a driver-made stream of the staging thread's own (its IPC event waits and
        finite checks neither queue behind the engine's copies nor hold them up). CPU: nothing."""
        if device.type != "cuda":
            return contextlib.nullcontext()
        torch.cuda.set_device(device)
        if self._stage_stream is None:
            self._stage_stream = EngineStream(device)  # kept with the receiver (streams are never destroyed)
        return torch.cuda.stream(self._stage_stream.stream)

    def apply_staged(self, staged: StagedUpdate, flush_cache: bool = True, push: PushPosition | None = None,
                     version: str | None = None) -> int:
        """Engine thread: copy a staged update (checked by `stage`). One dropped by a sleep meanwhile, or with the
        weights asleep now, writes nothing."""
        try:
            with self._staged_lock:
                if staged in self._staged:
                    self._staged.remove(staged)
            if staged.dropped is not None:
                raise LifecycleError(staged.dropped)
            self.check_awake("update_weights_from_tensor")
            if staged.ready is not None:  # opened on another thread's stream
                torch.cuda.current_stream(self.executor.driver.device).wait_event(staged.ready)
            names = [name for name, _ in staged.pairs]
            return self.write(names, lambda: self.executor.load_weights(staged.pairs, False, False, True), push,
                              flush_cache, version)
        finally:
            self._release(staged.pairs)

    def discard_staged(self, staged: StagedUpdate) -> None:
        """Release a staged update that will not be copied (its request was refused before its turn)."""
        with self._staged_lock:
            if staged in self._staged:
                self._staged.remove(staged)
        release_transfer_memory(staged.pairs)

    def _release(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """After a copy: the request's references to the trainer's memory go — all but the storages a `keeping`
        block keeps for the push's next requests."""
        with phase("sync"):
            self.executor.driver.synchronize()  # the copies done before the trainer may reuse its memory
        with phase("release"):
            if self._keeping is not None:
                for _, tensor in pairs:
                    storage = tensor.untyped_storage()
                    self._keeping[(storage.device, storage.data_ptr())] = storage
            release_transfer_memory(pairs)

    @contextlib.contextmanager
    def held(self, drop: bool) -> Iterator[None]:
        """Engine thread, around a sleep or wake: no payload is opened meanwhile (`stage` waits); with `drop` (the
        weights or the context go), every staged update is released first (its copy then writes nothing)."""
        with self.gate:
            if drop:
                with self._staged_lock:
                    staged, self._staged = self._staged, []
                for update in staged:
                    update.dropped = ("the weights went to sleep before this request's copy; nothing was written "
                                      "(wake them, then push again)")
                    release_transfer_memory(update.pairs)
                self.forget()
            yield

    # ---- mappings kept through a push ------------------------------------------------------------------------
    @contextlib.contextmanager
    def keeping(self, push: PushPosition | None) -> Iterator[None]:
        """Engine thread, around one request of a push whose trainer flattens its buckets into `push.keep` buffers
        reused in turn (torpor.rl.BucketRing): the storages the request opened stay open for the push's next
        requests, so each buffer is opened once per push — torch finds an open storage by its handle and maps it
        again only when none is alive. After the push's last request, or a failed one, they all go."""
        if push is None or not push.keep:
            yield
            return
        self._keeping = {}
        try:
            yield
        except BaseException:
            self._keeping = None
            self.forget(push.push_id)
            raise
        storages, self._keeping = self._keeping, None
        if push.last:
            self.forget(push.push_id)
            return
        with self._staged_lock:
            kept = self._kept.setdefault(push.push_id, OrderedDict())
            for key, storage in storages.items():
                kept[key] = storage
                kept.move_to_end(key)
            released = [kept.popitem(last=False)[1] for _ in range(max(0, len(kept) - push.keep))]
        released.clear()  # outside the lock: releasing a CUDA mapping is a driver call

    def forget(self, push_id: str | None = None) -> None:
        """Release the storages kept for the push `push_id` (None: for every push)."""
        with self._staged_lock:
            if push_id is None:
                released, self._kept = list(self._kept.values()), {}
            else:
                released = [self._kept.pop(push_id)] if push_id in self._kept else []
        released.clear()

    def kept(self, push_id: str | None = None) -> int:
        """How many storages are kept for `push_id` (None: for every push)."""
        with self._staged_lock:
            if push_id is None:
                return sum(len(k) for k in self._kept.values())
            return len(self._kept.get(push_id, ()))

    # ---- the distributed update (a process group to the trainer) -------------------------------------------------
    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str | None, timeout: float) -> None:
        """SGLang's init_weights_update_group: every rank joins as `rank_offset + rank`; a rank that fails to join
        makes every rank leave again."""
        if isinstance(rank_offset, bool) or not isinstance(rank_offset, int) or rank_offset < 1:
            raise ValueError(f"rank_offset must be >= 1 (rank 0 is the trainer's broadcasting rank), got "
                             f"{rank_offset!r}")
        if isinstance(world_size, int) and not isinstance(world_size, bool) and \
                rank_offset + self.world_size > world_size:
            raise ValueError(f"world_size {world_size} cannot hold the engine's {self.world_size} rank(s) from "
                             f"rank_offset {rank_offset} (needs at least {rank_offset + self.world_size})")
        if self.executor.driver.has_update_group(group_name):  # refused before any rank acts
            raise ValueError(f"weights update group {group_name!r} exists already; destroy it first")
        try:
            self.executor.collective_rpc("init_update_group", (master_address, master_port, rank_offset, world_size,
                                                               group_name, backend, timeout))
        except BaseException:
            self.executor.collective_rpc("destroy_update_group", (group_name,))
            raise

    def start_receive(self, names: Sequence[str], dtypes: Sequence, shapes: Sequence, group_name: str,
                      timeout_s: float | None = None, packed_bytes: int | None = None) -> None:
        """Every rank starts receiving the trainer's broadcasts on a thread of its own; the engine serves on the old
        weights meanwhile. Refused before the first receive (weights asleep, a name / shape / dtype the checkpoint
        does not have): the group is destroyed then too, since the trainer's broadcasts of it have no receiver."""
        try:
            self.check_awake("update_weights_from_distributed")
            if timeout_s is not None:
                check_timeout(timeout_s)  # -1 or 1e308 reached gloo: a misleading 409, or an int overflow's text
            specs = specs_of(names, dtypes, shapes)
            self.manifest.check([(n, torch.empty(s, dtype=d, device="meta")) for n, d, s in specs])
            if group_name in self._receiving:
                raise ValueError(f"weights update group {group_name!r} is receiving already")
            self.executor.collective_rpc("start_receive", (group_name, list(names), list(dtypes), list(shapes),
                                                           timeout_s, packed_bytes))
        except (ValueError, LifecycleError) as e:
            existed = self.executor.driver.has_update_group(group_name)
            self.executor.collective_rpc("drop_staged", (group_name, True))
            if existed:
                raise type(e)(f"{e} (weights update group {group_name!r} is destroyed: its stream is out of step "
                              "with the trainer; init it again)") from e
            raise
        self._receiving.add(group_name)

    def receive_done(self, group_name: str) -> bool:
        """Whether every rank has received (raises the first rank's receive error; the group is destroyed)."""
        try:
            return all(self.executor.collective_rpc("receive_done", (group_name,)))
        except BaseException:
            self._receiving.discard(group_name)
            self.executor.collective_rpc("drop_staged", (group_name, True))
            raise

    def wait_receive(self, group_name: str, timeout_s: float, waited_s: float | None = None) -> None:
        """Wait (at most `timeout_s`) for every rank's receive; one still running then gives the group up."""
        try:
            self.executor.collective_rpc("wait_receive", (group_name, timeout_s, waited_s))
        except BaseException:
            self._receiving.discard(group_name)
            self.executor.collective_rpc("drop_staged", (group_name, True))
            raise

    def apply_received(self, names: Sequence[str], group_name: str, flush_cache: bool = True,
                       push: PushPosition | None = None, version: str | None = None) -> int:
        """Copy what every rank received (each keeps its shard); a failure drops what every rank received."""
        self._receiving.discard(group_name)
        return self.apply_opened(names, group_name, push, flush_cache, version)

    def apply_opened(self, names: Sequence[str], key: str, push: PushPosition | None = None,
                     flush_cache: bool = True, version: str | None = None) -> int:
        """Copy what every rank holds under `key` (received, opened or given by a worker extension, checked), as
        (part of) one update; a failure drops it on every rank."""
        try:
            return self.write(list(names), lambda: self.executor.collective_rpc("apply_staged", (key,))[0], push,
                              flush_cache, version)
        except BaseException:
            self.executor.collective_rpc("drop_staged", (key, False))
            raise

    def receiving(self) -> list[str]:
        """The update groups receiving now (a sleep waits for none: it is refused meanwhile)."""
        return sorted(self._receiving)

    def destroy_group(self, group_name: str) -> None:
        """SGLang's destroy_weights_update_group (every rank leaves). Refused while the group receives: a gloo
        group's destructor waits for its broadcast in flight, so the engine thread (and every request) would stall
        until the receive's deadline; the receive ends by its timeout and destroys the group itself."""
        if group_name in self._receiving:
            raise LifecycleError(f"weights update group {group_name!r} is receiving the trainer's broadcasts "
                                 "(update_weights_from_distributed is pending); it is destroyed when that call "
                                 "fails, at its timeout at the latest, or destroy it after that call answered")
        if not self.executor.collective_rpc("destroy_update_group", (group_name,))[0]:
            raise ValueError(f"no weights update group {group_name!r}")

    def read(self, name: str, truncate_size: int, model) -> list:
        """SGLang's get_weights_by_name: the checkpoint tensor `name` as the engine holds it now (gathered from
        every rank), as float32 values, its first `truncate_size` rows (`tensor.tolist()[:truncate_size]`)."""
        if not isinstance(name, str) or not isinstance(truncate_size, int) or isinstance(truncate_size, bool) \
                or truncate_size < 0:
            raise ValueError("get_weights_by_name takes a tensor name and a truncate_size >= 0")
        self.check_awake("get_weights_by_name")
        manifest = self.manifest
        read = name
        if name not in manifest.shapes:
            raise ValueError(f"unknown tensor {name!r} (not in the model's checkpoint)")
        if model.is_ignored_weight(name):
            tied = "model.embed_tokens.weight"
            if name != "lm_head.weight" or tied not in manifest.shapes:
                raise ValueError(f"{name!r} is not held by the model (it ignores that checkpoint tensor)")
            read = tied  # SGLang answers the embedding for a tied head too
        shape = manifest.shapes[read]
        values = min(truncate_size, shape[0] if shape else 1) * (math.prod(shape[1:]) if shape else 1)
        if values > MAX_WEIGHT_VALUES:
            raise ValueError(f"get_weights_by_name: the answer would hold {values} values of {name!r}, at most "
                             f"{MAX_WEIGHT_VALUES}: lower truncate_size (it counts rows)")
        full = torch.zeros(shape, dtype=torch.float32)
        for pieces in self.executor.collective_rpc("read_weight", (read, list(shape))):
            for size, stride, offset, values in pieces:
                full.as_strided(size, stride, offset).copy_(values)
        return full[:truncate_size].tolist()


def check_version(version: object) -> str:
    """A weights label: a non-empty string of at most 256 characters (ValueError naming it otherwise)."""
    if not isinstance(version, str) or not version or len(version) > 256:
        raise ValueError(f"weight_version must be a non-empty string of at most 256 characters, got {version!r}")
    return version


def weight_names(manifest: Manifest, ignored: Callable[[str], bool]) -> frozenset[str]:
    """The tensors that make the weights whole: the checkpoint's, but those the model ignores."""
    return frozenset(n for n in manifest.shapes if not ignored(n))


def _ready_event(device: torch.device):
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _describe(value) -> str:
    if isinstance(value, list | tuple):
        return f"a list of {len(value)}"
    return type(value).__name__

