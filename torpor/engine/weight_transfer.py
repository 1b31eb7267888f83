"""Weights pushed into a running engine by a trainer in another process (SGLang's contract).

Two transports, one validation and one copy path:

- **Tensors by reference** (`update_weights_from_tensor`): the trainer pickles `[(name, tensor), ...]`, or a
  flattened bucket `{"flattened_tensor": t, "metadata": [(name, shape, dtype, start, end), ...]}`, with
  `torch.multiprocessing`'s ForkingPickler and sends it base64-encoded. CUDA tensors travel as CUDA IPC
  handles (the engine maps the trainer's memory and copies from it), CPU tensors as shared-memory files
  (the trainer sets the `file_system` sharing strategy). Unpickling a request body would be code execution:
  `RestrictedUnpickler` admits only torch's tensor and storage rebuild functions, dtypes, `torch.Size`,
  `torch.device` and plain containers, checks every shared-memory name and size before mapping it, and
  refuses everything else (`RefusedPickle`, a ValueError: HTTP 400) without calling it; every tensor view must
  lie inside its storage.
- **A process group** (`init_weights_update_group` / `update_weights_from_distributed`): the trainer's rank 0
  broadcasts each tensor, in order; NCCL on GPU, gloo on CPU. The group is standalone: a `TCPStore` at the
  trainer's address, a `PrefixStore` per group name and a `ProcessGroupGloo` / `ProcessGroupNCCL` built on
  it directly. It is never the default group and never goes through `new_group`, so the engine's own
  tensor-parallel group (the default group) is untouched, and destroying it is dropping the object.
  Before the backend is built every rank checks in on the store (`_rendezvous`) with a deadline, so a group
  that never forms is a clear `WeightTransferError` and nothing was created.

Both transports end in `apply_named_tensors`: the weights tag must be awake, every name / shape / dtype of
the bucket is checked against the checkpoint's manifest before a byte is written, then the bucket goes
through the engine's own `update_weights` path (fused q/k/v and gate/up handled there). After a level-2
sleep the weights are complete only once every checkpoint tensor arrived (possibly over many buckets);
until then the engine does not serve. References to the trainer's memory are dropped right after the copy
(`torch.cuda.ipc_collect()` releases the IPC mappings).
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from torpor.engine import phase_times
from torpor.engine.phase_times import phase
from torpor.engine.weights.manifest import Manifest
from torpor.engine.weights.payload import is_int, named_tensors_of, parse_dtype, unpickle_payload
from torpor.engine.weights.transport import (
    DEFAULT_GROUP_TIMEOUT_S,
    UpdateGroup,
    WeightTransferError,
    destroy_group_handle,
    open_update_group,
    receive_tensors,
)


class WeightReceiver:
    """The weight-push state of one engine: its checkpoint manifest and, after a level-2 sleep, which
    checkpoint tensors are still missing (buckets of one update arrive in several calls)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.manifest = Manifest.of_checkpoint(engine.config.model)
        self.missing: set[str] | None = None  # None: the weights are valid (not discarded)
        # `SleepMode.discards` when `missing` was counted from the whole manifest: another level-2 sleep meanwhile
        # zero-filled what came since, so the count starts over (a counter, not a look at the weights: no device
        # synchronization per request).
        self.discards_counted = 0
        # Held while a payload is opened off the engine thread (`stage`) and while a sleep or wake changes the
        # memory (`held`): no IPC handle is opened during a context checkpoint or restore.
        self.gate = threading.Lock()
        self._staged: list[StagedUpdate] = []  # opened, waiting for their copy (dropped by a sleep)
        # Storages of a trainer's memory kept open through a push whose trainer reuses its buffers (`keeping`),
        # by push id, the most recently used last; a sleep releases them all, as it drops the staged updates.
        self._kept: dict[str, OrderedDict[tuple, torch.UntypedStorage]] = {}
        self._keeping: dict[tuple, torch.UntypedStorage] | None = None  # noted by `_release` inside `keeping`
        self._staged_lock = threading.Lock()
        self._stage_stream = None  # EngineStream of the staging thread (CUDA), made on the first staged request

    def check_weights_awake(self, what: str) -> None:
        memory = self.engine.memory
        if memory is not None and "weights" in memory.tags() and memory.is_sleeping("weights"):
            raise RuntimeError(f"{what}: the weights are asleep; wake them first "
                               "(POST /wake_up?tags=weights, or wake_up(['weights']))")

    def decode(self, serialized: Sequence[str], load_format: str | None) -> list[tuple[str, torch.Tensor]]:
        """One base64 payload (`serialized_named_tensors` of one entry) -> named tensors (`apply` checks them
        against the manifest before anything is written). Rank 0 opens it; under tensor parallelism the
        engine streams the full tensors to the other ranks (one entry per rank goes through
        `_per_rank_update` instead)."""
        tp = self.engine.config.tensor_parallel_size
        if not isinstance(serialized, list | tuple) or len(serialized) not in (1, tp):
            raise ValueError(f"serialized_named_tensors must be a list of 1 or tensor_parallel_size ({tp}) "
                             f"base64 strings, got {_describe(serialized)}")
        with phase("decode"):
            payload = unpickle_payload(serialized[0], self.manifest.max_bytes)
            with phase("views"):  # inside "decode": the bucket's (name, view) pairs, their metadata checked
                pairs = named_tensors_of(payload, load_format)
            del payload
        return pairs

    def apply(self, named_tensors: list[tuple[str, torch.Tensor]], flush_cache: bool = True) -> int:
        """Copy checked tensors into the model through the engine's `update_weights` path. After a level-2
        sleep, the engine serves again once every checkpoint tensor came (over any number of calls)."""
        try:
            with phase("check"):
                self.manifest.check(named_tensors)
            return self._copy(named_tensors, flush_cache, staged=False)
        finally:
            self._release(named_tensors)

    def _copy(self, named_tensors: list[tuple[str, torch.Tensor]], flush_cache: bool, staged: bool) -> int:
        names = [name for name, _ in named_tensors]
        runner = self.engine.model_runner
        if self.discarded:  # part of the set: the engine's own path would want every tensor at once; the
            # RoPE table is recomputed once, when the set is complete (`commit`)
            return self.commit(names, lambda: runner.update_weights(named_tensors, strict=False, reset_buffers=False,
                                                                    staged=staged), flush_cache)
        return self.commit(names, lambda: self.engine.update_weights(named_tensors, staged=staged),
                           flush_cache)

    # ---- a push in flight: opened and checked off the engine thread, copied on it ----------------------
    def stage(self, serialized: Sequence[str], load_format: str | None) -> StagedUpdate:
        """Any thread but the engine's (TP=1): open one request's payload and check it — the weights awake, every
        name / shape / dtype against the manifest and the model (the meta dry run), the finite values — while the
        engine thread copies the previous one; `apply_staged` then copies it on the engine thread. CUDA tensors
        are opened on this thread's current stream (the trainer's IPC event is waited for there, and the finite
        check runs there): the staged update carries an event recorded after them, which the engine's stream
        waits for before reading them."""
        with phase_times.collect() as timings, self.gate:
            self.check_weights_awake("update_weights_from_tensor")  # before any handle is opened
            device = self.engine.model_runner.device
            with self._staging_stream(device):
                staged = self._open_and_check(serialized, load_format, device, timings)
            with self._staged_lock:
                self._staged.append(staged)
        return staged

    def _open_and_check(self, serialized: Sequence[str], load_format: str | None, device: torch.device,
                        timings: dict[str, float]) -> StagedUpdate:
        pairs = self.decode(serialized, load_format)
        try:
            from torpor.engine.weights.loader import check_staged

            with phase("check"):
                self.manifest.check(pairs)
            check_staged(_model(self.engine), pairs)  # the meta dry run and the finite values (this stream)
            return StagedUpdate(pairs, _ready_event(device), timings)
        except BaseException:
            release_transfer_memory(pairs)
            raise

    def _staging_stream(self, device: torch.device) -> contextlib.AbstractContextManager:
        """CUDA: the engine's device and a stream of the staging thread's own, made through the driver as the
        engine's is (no PyTorch stream pool): its IPC event waits and finite checks neither queue behind the
        engine's copies nor hold them up, as the threads' shared default stream would. CPU: nothing."""
        if device.type != "cuda":
            return contextlib.nullcontext()
        torch.cuda.set_device(device)  # this thread's CUDA calls (IPC opens, range checks) go there
        if self._stage_stream is None:
            from torpor.engine.engine_stream import EngineStream

            self._stage_stream = EngineStream(device)  # kept with the receiver (streams are never destroyed)
        return torch.cuda.stream(self._stage_stream.stream)

    def apply_staged(self, staged: StagedUpdate, flush_cache: bool = True) -> int:
        """Engine thread: copy a staged update (checked by `stage`; the coverage is checked here when the engine
        needs a whole set), synchronize, then release it. One dropped by a sleep meanwhile, or with the weights
        asleep now, is a 409 and writes nothing."""
        try:
            with self._staged_lock:
                if staged in self._staged:
                    self._staged.remove(staged)
            if staged.dropped is not None:
                raise RuntimeError(staged.dropped)
            self.check_weights_awake("update_weights_from_tensor")
            if staged.ready is not None:  # the tensors were opened on another thread's stream
                torch.cuda.current_stream(self.engine.model_runner.device).wait_event(staged.ready)
            return self._copy(staged.pairs, flush_cache, staged=True)
        finally:
            self._release(staged.pairs)

    def _release(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """Engine thread, after a copy: the request's references to the trainer's memory go — all but the
        storages a `keeping` block keeps for the push's next requests."""
        with phase("release"):
            if self._keeping is not None:
                for _, tensor in pairs:
                    storage = tensor.untyped_storage()
                    self._keeping[(storage.device, storage.data_ptr())] = storage
            release_transfer_memory(pairs)

    def discard_staged(self, staged: StagedUpdate) -> None:
        """Release a staged update that will not be copied (its request was refused before its turn)."""
        with self._staged_lock:
            if staged in self._staged:
                self._staged.remove(staged)
        release_transfer_memory(staged.pairs)

    @contextlib.contextmanager
    def held(self, drop: bool) -> Iterator[None]:
        """Engine thread, around a sleep or wake: no payload is opened meanwhile (`stage` waits); with `drop`,
        every staged update is released first (its copy answers 409): no IPC mapping of a trainer stays open
        while the weights or the CUDA context go."""
        with self.gate:
            if drop:
                self._drop_staged("the weights went to sleep before this request's copy; nothing was written "
                                  "(wake them, then push again)")
            yield

    def _drop_staged(self, reason: str) -> None:
        with self._staged_lock:
            staged, self._staged = self._staged, []
        for update in staged:
            update.dropped = reason
            release_transfer_memory(update.pairs)
        self.forget()

    # ---- mappings kept through a push -----------------------------------------------------------------
    @contextlib.contextmanager
    def keeping(self, push_id: str, count: int, last: bool) -> Iterator[None]:
        """Engine thread, around one request of a push whose trainer flattens its buckets into `count` buffers
        reused in turn (torpor.rl.BucketRing): the storages the request opened stay open for the push's next
        requests (the `count` most recently used), so each buffer is opened once per push — torch finds an open
        storage by its handle and maps it again only when none is alive (`rebuild_cuda_tensor`,
        `rebuild_storage_filename`); its new IPC event is then not waited for, and the pusher synchronizes every
        bucket before sending it. After the push's `last` request, or a failed one, every storage kept for the
        push goes."""
        self._keeping = {}
        try:
            yield
        except BaseException:
            self._keeping = None
            self.forget(push_id)
            raise
        storages, self._keeping = self._keeping, None
        if last:
            self.forget(push_id)
        else:
            self._keep(push_id, storages, count)

    def _keep(self, push_id: str, storages: dict[tuple, torch.UntypedStorage], count: int) -> None:
        with self._staged_lock:
            kept = self._kept.setdefault(push_id, OrderedDict())
            for key, storage in storages.items():
                kept[key] = storage
                kept.move_to_end(key)
            released = [kept.popitem(last=False)[1] for _ in range(max(0, len(kept) - count))]
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

    @property
    def discarded(self) -> bool:
        mode = self.engine.sleep_mode
        return mode is not None and mode.weights_discarded

    def commit(self, names: list[str], copy, flush_cache: bool) -> int:
        """Run `copy()` (checked tensors into the weights, on every rank; returns a count), then account for
        them: after a level-2 sleep the weights are valid once every checkpoint tensor came."""
        with phase("prepare"):
            self.check_weights_awake("update weights")
            engine, discarded = self.engine, self.discarded
            engine.mark_weights_dirty()  # every copy writes the weights (the ranks' own "apply" does not declare it)
            if discarded and (self.missing is None or self.discards_counted != engine.sleep_mode.discards):
                self.missing = {n for n in self.manifest.shapes if not _is_ignored(engine, n)}
                self.discards_counted = engine.sleep_mode.discards
        count = copy()
        with phase("sync"):
            _synchronize_copies(engine)  # copies done before the trainer may reuse its memory
        if discarded:
            self.missing -= set(names)
            if not self.missing:
                self.missing = None
                engine.model_runner.reset_buffers()  # discarded with the weights; the buckets left it (once here)
                engine._weights_restored()  # every tensor came: the weights are valid, serve again
        if flush_cache and not self.discarded:
            reset = getattr(engine, "reset_prefix_cache", None)
            if reset is not None:
                reset()
        return count

@dataclass(eq=False)
class StagedUpdate:
    """One request's tensors, opened and checked off the engine thread, waiting for their copy: `ready` is a
    CUDA event recorded after they were opened (None on CPU), `timings` the staging thread's phases, `dropped`
    why the copy will not happen (a sleep came first)."""

    pairs: list[tuple[str, torch.Tensor]]
    ready: object | None
    timings: dict[str, float]
    dropped: str | None = None


def _ready_event(device: torch.device):
    """An event on this thread's current stream of `device` (CUDA), after the work queued so far."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _model(engine):
    runner = engine.model_runner
    return runner.model if hasattr(runner, "model") else runner.local.model


def _synchronize_copies(engine) -> None:
    """An update's copies done. TP=1: they all ran on the engine's stream, so that stream only — the whole device
    would also wait for the staging thread's stream (the next request's finite check). Under tensor
    parallelism the device (rank 0's copies may also feed the engine group's collectives)."""
    runner = engine.model_runner
    stream = getattr(runner, "engine_stream", None)  # a ParallelRunner has none of its own
    if engine.config.tensor_parallel_size == 1 and stream is not None and stream.stream is not None:
        stream.stream.synchronize()
    else:
        _synchronize(runner.device)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_ignored(engine, name: str) -> bool:
    return bool(getattr(_model(engine), "is_ignored_weight", lambda n: False)(name))


def _describe(value) -> str:
    if isinstance(value, list | tuple):
        return f"a list of {len(value)}"
    return type(value).__name__


def release_transfer_memory(named_tensors: list) -> None:
    """Drop the references to the trainer's memory (IPC mappings, shared-memory files) and, on CUDA, let
    torch close the IPC handles now (`ipc_collect`)."""
    named_tensors.clear()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()


_receivers_lock = threading.Lock()  # a server's staging thread and its engine thread may both ask first


def receiver_of(engine) -> WeightReceiver:
    """The engine's WeightReceiver (made on first use; one per engine)."""
    receiver = getattr(engine, "_weight_receiver", None)
    if receiver is None:
        with _receivers_lock:
            receiver = getattr(engine, "_weight_receiver", None)
            if receiver is None:
                receiver = engine._weight_receiver = WeightReceiver(engine)
    return receiver


# ---- entry points (called with the engine to themselves: LLM's lock, or the server's engine thread) ----
def update_weights_from_tensor(engine, serialized_named_tensors: Sequence[str] | None = None,
                               load_format: str | None = None, flush_cache: bool = True,
                               named_tensors=None) -> int:
    """SGLang's `update_weights_from_tensor`: base64 payloads (one per rank), or, in process, the named
    tensors themselves (a list of pairs, or a flattened-bucket dict with load_format 'flattened_bucket').
    Returns how many tensors were loaded."""
    receiver = receiver_of(engine)
    receiver.check_weights_awake("update_weights_from_tensor")  # before any handle is opened
    if (serialized_named_tensors is None) == (named_tensors is None):
        raise ValueError("give exactly one of serialized_named_tensors and named_tensors")
    if not isinstance(flush_cache, bool):
        raise ValueError(f"flush_cache must be true or false, got {flush_cache!r}")
    tp = engine.config.tensor_parallel_size
    if named_tensors is not None:
        with phase("decode"):
            pairs = named_tensors_of(named_tensors if load_format else list(named_tensors), load_format)
    elif tp > 1 and isinstance(serialized_named_tensors, list | tuple) and len(serialized_named_tensors) == tp:
        return _per_rank_update(engine, receiver, list(serialized_named_tensors), load_format, flush_cache)
    else:
        pairs = receiver.decode(serialized_named_tensors, load_format)
    return receiver.apply(pairs, flush_cache)


def _per_rank_update(engine, receiver: WeightReceiver, serialized: list[str], load_format: str | None,
                     flush_cache: bool) -> int:
    """Tensor parallel with one payload per rank: every rank opens its own entry (on GPU: the trainer's rank
    on the same device) and checks it; only when every rank holds a checked bucket do they all copy."""
    runner = engine.model_runner
    try:
        names = runner.weights_group("open", serialized, load_format)
    except BaseException:
        runner.weights_group("drop", _OPENED)
        raise
    return receiver.commit(names, lambda: runner.weights_group("apply", _OPENED), flush_cache)


_OPENED = "\0opened"  # the staging key of a per-rank payload (no group name can hold a NUL)


_groups_lock = threading.Lock()  # every runner's groups (a server joins off the engine thread at TP=1)


def groups_of(runner) -> dict[str, UpdateGroup | None]:
    """One rank's groups, by name (None: reserved while it forms); they belong to its `ModelRunner` and go
    with it (`destroy_all_groups`), not with the process."""
    groups = getattr(runner, "_weight_groups", None)
    if groups is None:
        groups = runner._weight_groups = {}
    return groups



def init_weights_update_group(engine, master_address: str, master_port: int, rank_offset: int, world_size: int,
                              group_name: str, backend: str | None = None,
                              timeout: float = DEFAULT_GROUP_TIMEOUT_S) -> None:
    """SGLang's `init_weights_update_group`: every engine rank joins as `rank_offset + tp_rank`. Under tensor
    parallelism a rank that fails to join makes every rank leave again (no rank is left in the group)."""
    tp = engine.config.tensor_parallel_size
    if not is_int(rank_offset) or rank_offset < 1:
        raise ValueError(f"rank_offset must be >= 1 (rank 0 is the trainer's broadcasting rank), got {rank_offset!r}")
    if is_int(world_size) and rank_offset + tp > world_size:
        raise ValueError(f"world_size {world_size} cannot hold the engine's {tp} rank(s) from rank_offset "
                         f"{rank_offset} (needs at least {rank_offset + tp})")
    args = (master_address, master_port, rank_offset, world_size, group_name, backend, timeout)
    if tp == 1:
        rank_command(engine.model_runner, "init", *args)
        return
    runner = engine.model_runner
    if group_name in groups_of(runner.local):  # refused before any rank acts (the roll-back would destroy it)
        raise ValueError(f"weights update group {group_name!r} exists already; destroy it first")
    try:
        runner.weights_group("init", *args)
    except BaseException:
        runner.weights_group("drop", group_name)
        raise


def receive_named_tensors(runner, group_name: str, names: Sequence[str], dtypes: Sequence,
                          shapes: Sequence) -> list[tuple[str, torch.Tensor]]:
    """The trainer's broadcasts of `names` (in order) into fresh tensors on this rank's device. All
    checked before anything is received; a broadcast that fails (trainer gone, timeout, another size than
    declared) destroys the group and raises WeightTransferError (`transport.receive_tensors`). Nothing is
    written to the model here."""
    group = _group(runner, group_name)
    specs = _specs(names, dtypes, shapes)
    try:
        received = receive_tensors(group, specs)
    except WeightTransferError:
        destroy_update_group(runner, group_name)  # destroyed already: out of step with the trainer
        raise
    _synchronize(group.device)  # the broadcasts ran on the group's stream; the copies run on the engine's
    return received


def _specs(names, dtypes, shapes) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    if not all(isinstance(v, list | tuple) for v in (names, dtypes, shapes)) or \
            not len(names) == len(dtypes) == len(shapes) or not names:
        raise ValueError("names, dtypes and shapes must be non-empty lists of the same length")
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if not isinstance(name, str):
            raise ValueError(f"names must be strings, got {name!r}")
        if not isinstance(shape, list | tuple) or not all(is_int(d) and d >= 0 for d in shape):
            raise ValueError(f"shape of {name!r} must be a list of non-negative ints, got {shape!r}")
        specs.append((name, parse_dtype(dtype, f"dtype of {name!r}"), tuple(shape)))
    return specs


def _group(runner, group_name: str) -> UpdateGroup:
    with _groups_lock:
        groups = groups_of(runner)
        if group_name in groups and groups[group_name] is None:
            raise ValueError(f"weights update group {group_name!r} is still forming (init_weights_update_group)")
        group = groups.get(group_name)
    if group is None:
        raise ValueError(f"no weights update group {group_name!r}: call init_weights_update_group first")
    return group


def _reserve(groups: dict, group_name: str) -> None:
    """Hold `group_name` while it forms: a second init of it fails at once instead of replacing the first."""
    with _groups_lock:
        if group_name in groups:
            raise ValueError(f"weights update group {group_name!r} exists already; destroy it first")
        groups[group_name] = None


def update_weights_from_distributed(engine, names: Sequence[str], dtypes: Sequence, shapes: Sequence,
                                    group_name: str, flush_cache: bool = True) -> int:
    """SGLang's `update_weights_from_distributed`: every rank receives the trainer's broadcasts into fresh
    tensors; only once every rank has all of them are they copied (each rank keeps its shard). A failed
    receive on any rank drops what every rank received: nothing is written. Returns the tensors loaded.

    An update refused before its first receive (weights asleep, a name / shape / dtype the checkpoint does
    not have) destroys the group too: the trainer's broadcasts of it have no receiver, so the group's stream
    is out of step; the trainer's broadcasts fail at once instead of at the group's timeout."""
    receiver = receiver_of(engine)
    try:
        receiver.check_weights_awake("update_weights_from_distributed")
        specs = _specs(names, dtypes, shapes)
        receiver.manifest.check([(n, torch.empty(s, dtype=d, device="meta")) for n, d, s in specs])
    except (ValueError, RuntimeError) as e:
        if _abandon(engine, group_name):
            raise type(e)(f"{e} (weights update group {group_name!r} is destroyed: its stream is out of step "
                          "with the trainer; init it again)") from e
        raise
    names = [n for n, _, _ in specs]
    if engine.config.tensor_parallel_size == 1:
        pairs = receive_named_tensors(engine.model_runner, group_name, names, dtypes, shapes)
        return receiver.apply(pairs, flush_cache)
    runner = engine.model_runner
    try:
        runner.weights_group("receive", group_name, names, dtypes, shapes)
    except BaseException:
        runner.weights_group("drop", group_name)
        raise
    return receiver.commit(names, lambda: runner.weights_group("apply", group_name), flush_cache)


def _abandon(engine, group_name: str) -> bool:
    """Destroy `group_name` on every rank that has it; returns whether rank 0 had it."""
    runner = engine.model_runner
    if engine.config.tensor_parallel_size == 1:
        return destroy_update_group(runner, group_name)
    existed = _group_exists(runner.local, group_name)
    runner.weights_group("drop", group_name)
    return existed


def _group_exists(runner, group_name: str) -> bool:
    with _groups_lock:
        return groups_of(runner).get(group_name) is not None


def destroy_weights_update_group(engine, group_name: str) -> None:
    """SGLang's `destroy_weights_update_group` (every rank leaves)."""
    if engine.config.tensor_parallel_size == 1:
        rank_command(engine.model_runner, "destroy", group_name)
    else:
        engine.model_runner.weights_group("destroy", group_name)


# ---- one rank's part (rank 0 here; a tensor-parallel worker through its "weights_group" command) -----
_staged: dict[str, list[tuple[str, torch.Tensor]]] = {}  # received, not yet copied (this rank)


def rank_command(runner, op: str, *args):
    """One rank's part of a group operation: init, receive, apply, drop, destroy."""
    from torpor.engine.distributed import tp_rank

    if op == "init":
        address, port, rank_offset, world_size, group_name, backend, timeout = args
        groups = groups_of(runner)
        _reserve(groups, group_name)
        try:
            group = open_update_group(address, port, rank_offset + tp_rank(), world_size, group_name, backend,
                                      runner.device, timeout)
        except BaseException:
            with _groups_lock:
                groups.pop(group_name, None)
            raise
        with _groups_lock:
            groups[group_name] = group
        return None
    if op == "open":  # this rank's entry of a per-rank update_weights_from_tensor
        serialized, load_format = args
        manifest = _rank_manifest(runner)
        pairs = named_tensors_of(unpickle_payload(serialized[tp_rank()], manifest.max_bytes), load_format)
        manifest.check(pairs)
        _staged[_OPENED] = pairs
        return [name for name, _ in pairs]
    if op == "receive":
        group_name, names, dtypes, shapes = args
        _staged[group_name] = receive_named_tensors(runner, group_name, names, dtypes, shapes)
        return len(_staged[group_name])
    if op == "apply":
        (group_name,) = args
        tensors = _staged.pop(group_name)
        try:  # a partial set after a discard: the receiver's commit recomputes the RoPE table once complete
            count = runner.update_weights(tensors, strict=False, reset_buffers=False)
            _synchronize(runner.device)  # before the trainer's memory is released
            return count
        finally:
            release_transfer_memory(tensors)
    if op == "drop":  # a failed or refused update: its staged tensors go, and the group (out of step) with them
        _staged.pop(args[0], None)
        destroy_update_group(runner, args[0])
        return None
    if op == "destroy":
        _staged.pop(args[0], None)
        if not destroy_update_group(runner, args[0]):
            raise ValueError(f"no weights update group {args[0]!r}")
        return None
    raise ValueError(f"unknown weights group operation {op!r}")


_manifests: dict[str, Manifest] = {}  # this process's checkpoint manifests, by path


def _rank_manifest(runner) -> Manifest:
    path = runner.config.model
    if path not in _manifests:
        _manifests[path] = Manifest.of_checkpoint(path)
    return _manifests[path]


def destroy_update_group(runner, group_name: str) -> bool:
    """Forget the group (its communicator goes with the object). Returns whether it existed (one still
    forming is left to its init)."""
    with _groups_lock:
        groups = groups_of(runner)
        group = groups.pop(group_name) if groups.get(group_name) is not None else None
    if group is None:
        return False
    destroy_group_handle(group)
    return True


def destroy_all_groups(runner) -> None:
    """Every group of this rank (its engine closes): their sockets and threads go now."""
    with _groups_lock:
        names = [name for name, group in groups_of(runner).items() if group is not None]
    for name in names:
        destroy_update_group(runner, name)


