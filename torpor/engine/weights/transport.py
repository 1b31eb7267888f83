"""Process groups to a trainer: standalone gloo / NCCL groups formed as SGLang forms them (torch's `tcp://`
rendezvous on the trainer's store, torch's key naming; never the default group), their broadcasts and a bounded
wait for them. Shared by the engine's receiver and `torpor.rl`'s sender."""

from __future__ import annotations

import contextlib
import os
import re
import reprlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch

from torpor.engine.weights.payload import is_int

DEFAULT_GROUP_TIMEOUT_S = 120.0


class WeightTransferError(RuntimeError):
    """A weight transfer that could not happen (group never formed, trainer gone); nothing was written."""



# ---- the process-group transport ---------------------------------------------------------------------
@dataclass
class UpdateGroup:
    """One standalone process group to a trainer (rank `rank` of `world_size`; the trainer is rank 0)."""

    name: str
    rank: int
    world_size: int
    backend: str
    group: object  # ProcessGroupGloo / ProcessGroupNCCL (None once destroyed)
    device: torch.device
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S  # how long a receive waits for the trainer's broadcasts
    destroyed: bool = False



def open_update_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                      backend: str | None, device: torch.device, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
                      give_up: Callable[[], str | None] | None = None) -> UpdateGroup:
    """Join the standalone group `group_name` as `rank` (rank 0, the trainer: host it), formed exactly as SGLang's
    `init_custom_process_group` forms it, so a trainer that calls that (or torch's `tcp://` rendezvous and
    `_new_process_group_helper`) and then broadcasts from rank 0 is served unchanged: `_rendezvous`, then
    `_backend_group`. A rank missing after `timeout_s` → WeightTransferError, and nothing is left behind.
    `give_up` (rank 0): polled while the host waits for the others; a reason it returns ends the wait at once
    (e.g. the engine refused to join)."""
    _check_group_args(master_address, master_port, rank, world_size, group_name, backend, timeout_s)
    backend = _backend_for(backend, device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    timeout = timedelta(seconds=timeout_s)
    store = _rendezvous(master_address.strip("[]"), master_port, rank, world_size, group_name, timeout, give_up)
    # The communicator and its streams form on `device` (the caller's current device is given back after).
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        try:
            group = _backend_group(store, group_name, rank, world_size, backend, timeout)
        except RuntimeError as e:  # gloo connects every pair now: a rank that never came is its store's timeout
            failure = _first_line(e)
        else:
            return UpdateGroup(group_name, rank, world_size, backend, group, device, timeout_s)
    del store  # raised from here, the error holds no frame that holds the store (its socket goes now)
    raise WeightTransferError(f"weights update group {group_name!r} did not form within {timeout_s:g} s: not every "
                              f"one of its {world_size} ranks joined (this one is rank {rank}): {failure}")


def _rendezvous(address: str, port: int, rank: int, world_size: int, group_name: str, timeout: timedelta,
                give_up: Callable[[], str | None] | None):
    """torch's `tcp://address:port` rendezvous (`torch.distributed.rendezvous`, as SGLang's trainers and engines
    run it): rank 0 hosts a TCPStore there and waits until all `world_size` ranks counted themselves in; every
    other rank connects and counts itself in. Returns the group's store, `PrefixStore(group_name, store)`."""
    import torch.distributed as dist

    if rank == 0:
        store = _host_store(address, port, world_size, group_name, timeout, give_up)
    else:
        try:
            store = dist.TCPStore(address, port, world_size, False, timeout=timeout)  # counts itself in
        except (RuntimeError, OSError) as e:
            raise WeightTransferError(f"weights update group {group_name!r}: cannot reach the trainer's store at "
                                      f"{address}:{port} within {timeout.total_seconds():g} s: "
                                      f"{_first_line(e)}") from None
    return dist.PrefixStore(group_name, store)


def _host_store(address: str, port: int, world_size: int, group_name: str, timeout: timedelta,
                give_up: Callable[[], str | None] | None):
    """Rank 0's store: it waits in its constructor (the GIL released) for every rank, on a thread of its own, so
    `give_up` is polled meanwhile; when it gives a reason the missing ranks are counted in here, which ends the
    wait at once, and the store goes."""
    import torch.distributed as dist

    made: dict = {}

    def host() -> None:
        try:
            made["store"] = dist.TCPStore(address, port, world_size, True, timeout=timeout)
        except (RuntimeError, OSError) as e:
            made["error"] = e

    waiting = threading.Thread(target=host, name="torpor-weights-store", daemon=True)
    waiting.start()
    while waiting.is_alive():
        waiting.join(0.02)
        reason = give_up() if give_up is not None and waiting.is_alive() else None
        if reason:
            standins = []
            with contextlib.suppress(RuntimeError, OSError):  # else the host's own timeout ends its wait
                standins += [dist.TCPStore(address, port, world_size, False, timeout=timeout)
                             for _ in range(world_size - 1)]
            waiting.join(timeout.total_seconds())
            del standins, made
            raise WeightTransferError(f"weights update group {group_name!r} will not form: {reason}")
    if "error" in made:  # e.g. "Timed out after 121 seconds waiting for clients. 1/2 clients joined."
        raise WeightTransferError(f"weights update group {group_name!r} did not form within "
                                  f"{timeout.total_seconds():g} s: {_first_line(made['error'])}")
    return made["store"]


def _backend_group(store, group_name: str, rank: int, world_size: int, backend: str, timeout: timedelta):
    """The group's backend, on the keys torch's `_new_process_group_helper` gives it: the group's store is
    `PrefixStore(f"{group_name}/", store)`, its backend's `PrefixStore(f"{device}/", ...)` with the backend's first
    device ("cpu" for gloo, "cuda" for NCCL). Built directly, never registered with torch.distributed: the engine's
    own default group (its tensor-parallel group) stays untouched, and the group goes with the object. No warm-up
    collective: a trainer's first broadcast is its first tensor (NCCL forms its communicator then)."""
    import torch.distributed as dist

    prefix = dist.PrefixStore(f"{group_name}/", store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", prefix), rank, world_size, timeout)
    else:
        group = _nccl_group(dist.PrefixStore("cuda/", prefix), rank, world_size, timeout)
    group._set_sequence_number_for_group()  # as torch's helper does (numbers for its debugging tools)
    return group


def _first_line(error: BaseException) -> str:
    """An error's message without the C++ stack torch appends."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


# A receive gives up on the trainer at its deadline (the group's timeout from its start, by default) and aborts the
# communicator itself; NCCL's watchdog, which acts at its own timeout, gets this much longer than the group's, so the
# receive's error (and its roll-back) comes first.
_WATCHDOG_MARGIN = timedelta(seconds=30)
_nccl_env_lock = threading.Lock()


def _nccl_group(store, rank: int, world_size: int, timeout: timedelta):
    """A ProcessGroupNCCL whose watchdog, on an error or at its timeout, aborts the communicator and leaves the
    process alive (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, "clean up only", read by the constructor). PyTorch's default
    (3) ends the process: a trainer that died mid-update would take the serving engine with it."""
    import torch.distributed as dist

    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout + _WATCHDOG_MARGIN
    name = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    with _nccl_env_lock:  # the variable is the process's: set only while this group is made
        before = os.environ.get(name)
        os.environ[name] = "2"
        try:
            return dist.ProcessGroupNCCL(store, rank, world_size, options)
        finally:
            if before is None:
                del os.environ[name]
            else:
                os.environ[name] = before


MAX_WORLD_SIZE = 1 << 16  # ranks of one group (the trainer's and every engine's)
MAX_GROUP_TIMEOUT_S = 3600.0
_ADDRESS = re.compile(r"[\w.:%\[\]-]{1,255}")  # a host name, an IPv4 or IPv6 address ([::1] too)


def _check_group_args(address, port, rank, world_size, name, backend, timeout_s) -> None:
    """Every argument of a group call, in the API's words; JSON's true is no number here (Python's bool is an int)."""
    if not isinstance(address, str) or not _ADDRESS.fullmatch(address):
        raise ValueError(f"master_address must be a host name or an IP address, got {reprlib.repr(address)}")
    if not is_int(port) or not 0 < port < 65536:
        raise ValueError(f"master_port must be an integer in [1, 65535], got {reprlib.repr(port)}")
    if not is_int(world_size) or not 2 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be an integer in [2, {MAX_WORLD_SIZE}] (the trainer's rank 0 and the "
                         f"engine's ranks), got {reprlib.repr(world_size)}")
    if not is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(f"rank {reprlib.repr(rank)} (rank_offset + the engine's tensor-parallel rank; the trainer "
                         f"is rank 0) must lie in [0, world_size) = [0, {world_size})")
    if not isinstance(name, str) or not re.fullmatch(r"[\w.-]{1,128}", name):
        raise ValueError(f"group_name must be 1-128 letters, digits, '_', '.' or '-', got {reprlib.repr(name)}")
    if backend not in (None, "nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {reprlib.repr(backend)}")
    check_timeout(timeout_s)


def check_timeout(timeout_s) -> None:
    """A group's or a receive's `timeout`, in the API's words: a number of seconds in (0, MAX_GROUP_TIMEOUT_S]."""
    if not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool) or \
            not 0 < timeout_s <= MAX_GROUP_TIMEOUT_S:
        raise ValueError(f"timeout must be a number of seconds in (0, {MAX_GROUP_TIMEOUT_S:g}], got "
                         f"{reprlib.repr(timeout_s)}")


def _backend_for(backend: str | None, device: torch.device) -> str:
    default = "nccl" if device.type == "cuda" else "gloo"
    backend = backend or default
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("backend 'nccl' needs a CUDA engine; on CPU use 'gloo'")
    return backend


def broadcast(group: UpdateGroup, tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's `tensor` into everyone's, in place. gloo: blocks until done (or the group's timeout); NCCL: the
    current stream waits for it (`await_work` waits for it on the host, within a timeout)."""
    _start_broadcast(group, tensor)
    return tensor


def _start_broadcast(group: UpdateGroup, tensor: torch.Tensor, timeout: timedelta | None = None):
    """`broadcast`, returning its work (what `await_work` waits for); `timeout`: this broadcast's own (default:
    the group's)."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    if timeout is not None:
        options.timeout = timeout
    work = group.group.broadcast([tensor], options)
    work.wait()
    return work


def await_work(last, timeout_s: float, poll_s: float = 1e-4) -> None:
    """Wait on the host until the collectives up to `last` (a process-group work; NCCL's run in order on the
    group's stream) are done, for at most `timeout_s`: a CUDA synchronize would wait forever for a trainer that
    died mid-broadcast. Raises TimeoutError at the deadline (the caller destroys the group: its abort ends the
    kernels still waiting), or the work's error if it ended in one."""
    deadline = time.monotonic() + timeout_s
    while not last.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the trainer's broadcasts did not complete within {timeout_s:g} s")
        time.sleep(poll_s)
    # Set when NCCL reported an error or the watchdog aborted the communicator (PyTorch calls the API deprecated and
    # says so once per process on stderr; a completed NCCL work has no other way to tell failure from success).
    error = last.exception()
    if error is not None:
        raise RuntimeError(f"the broadcast failed: {error}")



def destroy_group_handle(group: UpdateGroup) -> None:
    """End one group's communicator (NCCL: abort it; gloo: its sockets close with the object). Once."""
    if group.destroyed:
        return
    group.destroyed = True
    backend, group.group = group.group, None  # the last reference, whoever still holds the handle (a traceback)
    if group.backend == "nccl" and getattr(backend, "abort", None) is not None:
        backend.abort()  # never gloo's: it does not end a wait, and leaves a thread that ends the process at exit
    del backend  # gloo: its sockets close now, and the trainer's next broadcast fails at once


# ---- receiving an update ------------------------------------------------------------------------------
Spec = tuple[str, torch.dtype, tuple[int, ...]]  # a tensor the trainer broadcasts: name, dtype, shape
MAX_ITEMSIZE = 8  # the largest element a trainer's tensor has (float64)
_WINDOW = 16  # bytes past a tensor's end, watched for a broadcast longer than declared
_UNWRITTEN = 0xFF  # what the watched bytes of a receive buffer hold before a broadcast


def receive_tensors(group: UpdateGroup, specs: Sequence[Spec], deadline: float | None = None,
                    stream: torch.cuda.Stream | None = None) -> list[tuple[str, torch.Tensor]]:
    """The trainer's broadcasts of `specs`, in order, into fresh tensors on the group's device, by `deadline` (a
    `time.monotonic()` value; default: the group's timeout from now). Touches no engine state, so it may run on a
    thread of its own while the engine serves; on CUDA the tensors are made (and NCCL's broadcasts queued) on
    `stream` (default: that thread's current stream), and when it returns every tensor is complete on the device.
    Whatever the trainer does, the engine lives on: a broadcast of another size than declared (float32 for a
    declared bfloat16, a tensor out of order) is a WeightTransferError naming the tensor, and so is a trainer gone,
    or one that stops sending (at the deadline: the error says how many tensors arrived); the group is then
    destroyed (the trainer's stream and this one are out of step), which also ends a collective still waiting, and
    nothing is returned. Writes nothing to the model.

    gloo ends the process (`GLOO_ENFORCE` in its I/O thread: SIGABRT) when a broadcast is larger than the receive
    buffer; a smaller one completes, filling part of the buffer, and gloo says nothing of how much. So every
    broadcast lands in a host buffer of `MAX_ITEMSIZE` bytes per element (a tensor in any dtype fits; see
    `_receive_gloo` for which tensor's elements), the bytes around the declared end are watched (`_size_mismatch`),
    and the declared bytes are copied into the fresh tensor. A broadcast larger than that bound still ends the
    process. Each gloo broadcast waits until the deadline at most (its own timeout): neither destroying nor aborting
    a gloo group ends a broadcast that waits, only its timeout does. NCCL checks no sizes either: a mismatch there
    puts the two streams out of step (bytes of one tensor land in the next, one side waits for bytes that never
    come) and cannot be seen from this side, so NCCL receives into the declared tensors directly; what bounds it is
    the wait, polled on the host until the deadline, then the abort (which ends the kernels still waiting), and the
    finite check every update passes before a byte is written."""
    if not specs:
        return []
    deadline = time.monotonic() + group.timeout_s if deadline is None else deadline
    received: list[tuple[str, torch.Tensor]] = []
    try:
        with _on(group.device, stream):
            if group.backend == "gloo":
                _receive_gloo(group, specs, deadline, received)
            else:
                _receive_nccl(group, specs, deadline, received)
    except Exception as e:
        late = time.monotonic() >= deadline - 0.05  # gloo's own timeout, in whole milliseconds, may come first
        cause = "the deadline passed: the trainer sent nothing more" if late else str(e)
    else:
        return received
    destroy_group_handle(group)  # raised from here, the error holds no frame that holds the tensors or the group
    arrived = len(received)
    received.clear()
    raise WeightTransferError(f"weights update group {group.name!r} failed after {arrived} of {len(specs)} tensors "
                              f"arrived; the group is destroyed (out of step with the trainer: init it again); "
                              f"nothing was written, the previous weights stay: {cause}")


@contextlib.contextmanager
def _on(device: torch.device, stream: torch.cuda.Stream | None) -> Iterator[None]:
    """CUDA: `device` (this thread's CUDA calls go there) and `stream`, given back after. CPU: nothing."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        yield


def _remaining(deadline: float) -> timedelta:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline passed")
    return timedelta(seconds=left)


def _receive_gloo(group: UpdateGroup, specs: Sequence[Spec], deadline: float, received: list) -> None:
    sizes = [MAX_ITEMSIZE * _numel(shape) + _WINDOW for _, _, shape in specs]
    # gloo's broadcast is a binomial tree: from 4 ranks on, engine ranks forward their whole buffer to others, so
    # there each broadcast gets a buffer of its own tensor's bound (a dtype mistake fits); up to 3 ranks nothing
    # is forwarded and every one gets the largest bound (a tensor out of order fits too). The same on every rank.
    shared = group.world_size <= 3
    buffer = torch.empty(max(sizes), dtype=torch.uint8)
    for (name, dtype, shape), size in zip(specs, sizes, strict=True):
        nbytes = _numel(shape) * dtype.itemsize
        view = buffer if shared else buffer[:size]
        view[max(0, nbytes - 1):nbytes + _WINDOW].fill_(_UNWRITTEN)
        _start_broadcast(group, view, _remaining(deadline))
        problem = _size_mismatch(view, nbytes)
        if problem:
            raise ValueError(f"the trainer's broadcast of {name!r} {problem} than its declared {dtype} "
                             f"{list(shape)} ({nbytes} bytes): another dtype, shape or order than declared?")
        tensor = torch.empty(shape, dtype=dtype, device=group.device)
        tensor.view(-1).view(torch.uint8).copy_(view[:nbytes])
        received.append((name, tensor))
    if group.device.type == "cuda":
        torch.cuda.current_stream(group.device).synchronize()  # the copies to the device are done


def _size_mismatch(buffer: torch.Tensor, nbytes: int) -> str | None:
    """'was longer' when a watched byte after the declared end was written; 'was shorter' when the declared last
    byte was not (it still holds the fill: a last value that is not finite, or beyond 2**127 in magnitude, in every
    float dtype, which the update would refuse anyway)."""
    if bool((buffer[nbytes:nbytes + _WINDOW] != _UNWRITTEN).any()):
        return "was longer"
    if nbytes and int(buffer[nbytes - 1]) == _UNWRITTEN:
        return "was shorter (or its last value is not finite)"
    return None


def _receive_nccl(group: UpdateGroup, specs: Sequence[Spec], deadline: float, received: list) -> None:
    last = None
    for name, dtype, shape in specs:
        tensor = torch.empty(shape, dtype=dtype, device=group.device)
        last = _start_broadcast(group, tensor)
        received.append((name, tensor))
    if last is not None:  # NCCL's broadcasts return before their data moved
        await_work(last, max(0.0, deadline - time.monotonic()))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

