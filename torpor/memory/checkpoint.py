"""Sleep to zero: hand this process's whole CUDA context to the driver's checkpoint API and back.

The CUDA driver (r570+) can checkpoint a process's device state to host memory and restore it
(`cuCheckpointProcessLock / Checkpoint / Restore / Unlock / GetState` on a PID). A process cannot do it
to itself (on its own PID the lock and the checkpoint returned and the process never progressed again),
so a persistent helper process does it for us: started on first use, it initializes the driver once and
stays up (starting one per call costs seconds of driver attach). See checkpoint_helper.py for its protocol.

    from torpor.memory import checkpoint
    checkpoint.check_support()                    # CheckpointUnsupportedError says why not; touches nothing
    report = checkpoint.checkpoint_process()      # device memory of this process: 0 MiB
    ...                                           # no CUDA call from this process until the restore
    checkpoint.restore_process()                  # same context, same addresses, graphs valid

Move the bulk of the memory with `MemoryManager.sleep` first: the driver copies at ~2 GB/s, torpor's
tags at the host link's speed, so the checkpoint should only see the residue (context, kernel code).
`MemoryManager.checkpoint_context()` does both checks and bookkeeping around these calls. While the
process is checkpointed every CUDA call it makes blocks until the restore: nothing may make one.
Limits (NVIDIA's): one process, no UVM, no CUDA IPC, no NCCL.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from torpor.memory.types import TorporMemoryError

HELPER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint_helper.py")
START_TIMEOUT_S = 60.0  # cuInit in the helper can take seconds on a large machine
STATE_TIMEOUT_S = 30.0


class CheckpointUnsupportedError(TorporMemoryError, ValueError):
    """A precondition of a context checkpoint is not met (driver, bindings, backend, tensor parallel,
    work in flight); nothing was touched."""


class CheckpointError(TorporMemoryError):
    """A checkpoint or restore failed, or the helper process did not answer; the message says the state."""


class ContextCheckpointedError(TorporMemoryError):
    """A call that needs the CUDA context was made while the process is checkpointed."""


@dataclass(frozen=True)
class CheckpointReport:
    """One checkpoint or restore of this process's CUDA context."""

    kind: str  # "checkpoint" | "restore"
    seconds: float  # the whole call, pipe round trip included
    held_bytes: int  # device memory the checkpoint took from the process: what a restore needs
    device: dict = field(default_factory=dict)  # NVML after the call: total/free/used/process bytes ({} unknown)
    # The driver's calls, timed by the helper: lock_s + checkpoint_s, or restore_s + unlock_s; `seconds` minus
    # their sum is the pipe round trip and the helper's NVML readings.
    driver_s: dict = field(default_factory=dict)

    def __str__(self) -> str:
        driver = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in self.driver_s.items())
        return (f"{self.kind}: {self.held_bytes / 2**20:.0f} MiB of CUDA context in {self.seconds * 1e3:.0f} ms"
                + (f" (driver: {driver})" if driver else ""))


class CheckpointHelper:
    """The helper process and its pipe. One request at a time; a request that does not get its answer
    within its timeout stops the helper (the next request starts a fresh one) and raises CheckpointError."""

    def __init__(self, python: str = sys.executable, path: str = HELPER_PATH) -> None:
        self.argv = [python, "-u", path]
        self.process: subprocess.Popen | None = None
        self._stderr = None
        self._buffer = b""
        self._lock = threading.Lock()
        self.hello: dict = {}

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def request(self, op: str, timeout_s: float, **fields) -> dict:
        """Send `op` with `fields`; the helper's reply. CheckpointError on a timeout, a dead helper or an
        error reply."""
        with self._lock:
            if self.process is None or self.process.poll() is not None:
                self._start()
            reply = self._round_trip({"op": op, **fields}, timeout_s, op)
        if not reply.get("ok"):
            raise CheckpointError(f"checkpoint helper: {op}: {reply.get('error')}")
        return reply

    def _start(self) -> None:
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the helper)
        self._buffer = b""
        self.process = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self._stderr, close_fds=True)
        self.hello = self._round_trip({"op": "hello"}, START_TIMEOUT_S, "start")

    def _round_trip(self, message: dict, timeout_s: float, what: str) -> dict:
        proc = self.process
        try:
            proc.stdin.write((json.dumps(message) + "\n").encode())
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died(what) from None
        deadline = time.monotonic() + timeout_s
        fd = proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                raise CheckpointError(f"the checkpoint helper did not answer {what!r} within {timeout_s:.0f} s; "
                                      "it was stopped (the next call starts a new one)")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise self._died(what)
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _died(self, what: str) -> CheckpointError:
        proc = self.process
        try:
            code = proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        tail = ""
        if self._stderr is not None:
            self._stderr.seek(0)
            tail = self._stderr.read()[-1500:].decode(errors="replace").strip()
        self.process = None
        return CheckpointError(f"the checkpoint helper (pid {proc.pid}) exited with code {code} during {what!r}"
                               + (f": {tail}" if tail else "") + " (the next call starts a new one)")

    def stop(self) -> None:
        """End the helper (kill it if it does not end on its own)."""
        proc, self.process = self.process, None
        if proc is None:
            return
        with _suppress():
            proc.stdin.close()
        try:
            proc.wait(2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        with _suppress():
            proc.stdout.close()


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return exc[0] is not None and issubclass(exc[0], OSError)


_HELPER: CheckpointHelper | None = None
_HELPER_LOCK = threading.Lock()
_CURRENT: CheckpointReport | None = None  # set while this process is checkpointed
_LAST_RESTORE: CheckpointReport | None = None  # the latest restore (its timings), for reports
_PCI_BUS_ID: str | None = None


def helper() -> CheckpointHelper:
    """This process's helper (made on first use; its process starts with the first request)."""
    global _HELPER
    with _HELPER_LOCK:
        if _HELPER is None:
            _HELPER = CheckpointHelper()
        return _HELPER


def is_checkpointed() -> bool:
    """Whether this process's CUDA context is checkpointed now (known locally: no CUDA, no helper call)."""
    return _CURRENT is not None


def current() -> CheckpointReport | None:
    """The checkpoint in force, if any."""
    return _CURRENT


def check_support(pci_bus_id: str | None = None) -> None:
    """Raise CheckpointUnsupportedError naming the reason when this process cannot be checkpointed: no
    cuda-bindings or too old, a driver older than r570, no CUDA state in this process. Starts the helper."""
    global _PCI_BUS_ID
    try:
        hello = helper().request("hello", START_TIMEOUT_S)
    except CheckpointError as exc:
        raise CheckpointUnsupportedError(f"the checkpoint helper could not start: {exc}") from None
    if hello.get("problem"):
        raise CheckpointUnsupportedError(f"the CUDA checkpoint API is not usable here: {hello['problem']}")
    try:
        state = helper().request("state", STATE_TIMEOUT_S, pid=os.getpid())["state"]
    except CheckpointError as exc:
        raise CheckpointUnsupportedError(f"the driver cannot checkpoint this process: {exc}") from None
    if state != "running":
        raise CheckpointUnsupportedError(f"this process's CUDA state is {state!r}, not 'running'")
    if pci_bus_id is not None:
        _PCI_BUS_ID = pci_bus_id


def checkpoint_process(pci_bus_id: str | None = None, lock_timeout_s: float = 10.0,
                       timeout_s: float = 300.0) -> CheckpointReport:
    """Lock this process's CUDA state and checkpoint it to host memory (device memory of the process: 0).
    Call `check_support` first. Every thread must be out of CUDA calls within `lock_timeout_s` (the lock
    waits for them), and none may make one until `restore_process`. On failure the process is unlocked
    and running, as before, and CheckpointError is raised."""
    global _CURRENT, _PCI_BUS_ID
    if _CURRENT is not None:
        raise CheckpointError("this process is already checkpointed")
    _PCI_BUS_ID = pci_bus_id or _PCI_BUS_ID
    start = time.perf_counter()
    try:
        reply = helper().request("checkpoint", timeout_s, pid=os.getpid(), pci_bus_id=_PCI_BUS_ID,
                                 lock_timeout_ms=int(lock_timeout_s * 1000))
    except CheckpointError as exc:
        state = _recover()
        if state != "running":  # CUDA calls would block: count the process as checkpointed
            _CURRENT = CheckpointReport("checkpoint", time.perf_counter() - start, 0)
            raise CheckpointError(f"{exc}; this process's CUDA state is {state!r}: no CUDA call may be made "
                                  "until restore_process() succeeds") from None
        raise CheckpointError(f"{exc}; the process is running as before") from None
    _CURRENT = CheckpointReport("checkpoint", time.perf_counter() - start, int(reply["held_bytes"]),
                                reply.get("after") or {}, _driver_seconds(reply, "lock_s", "checkpoint_s"))
    return _CURRENT


def _driver_seconds(reply: dict, *names: str) -> dict:
    return {name: float(reply[name]) for name in names if name in reply}


def _recover() -> str:
    """After a failed checkpoint: bring this process back to running (a fresh helper if the old one was
    stopped); its state afterwards, or "unknown"."""
    try:
        return helper().request("recover", START_TIMEOUT_S, pid=os.getpid())["state"]
    except CheckpointError:
        return "unknown"


def restore_process(timeout_s: float = 300.0) -> CheckpointReport | None:
    """Restore the checkpointed CUDA state and unlock the process (None if it is not checkpointed). Checks
    first that the device has the memory the checkpoint held: if not, CheckpointError and the process
    stays checkpointed (free memory, then retry)."""
    global _CURRENT, _LAST_RESTORE
    if _CURRENT is None:
        return None
    start = time.perf_counter()
    reply = helper().request("restore", timeout_s, pid=os.getpid(), pci_bus_id=_PCI_BUS_ID,
                             need_bytes=_CURRENT.held_bytes)
    held, _CURRENT = _CURRENT.held_bytes, None
    _LAST_RESTORE = CheckpointReport("restore", time.perf_counter() - start, held,
                                     driver_s=_driver_seconds(reply, "restore_s", "unlock_s"))
    return _LAST_RESTORE


def last_restore() -> CheckpointReport | None:
    """The latest restore of this process (what a level-3 wake spent in the driver), if any."""
    return _LAST_RESTORE


def device_readings(timeout_s: float = STATE_TIMEOUT_S) -> dict:
    """NVML readings of this process's device, taken by the helper (safe while checkpointed): total, free,
    used and this process's bytes; {} where NVML or the device's bus id is unknown."""
    if _PCI_BUS_ID is None:
        return {}
    return helper().request("memory", timeout_s, pid=os.getpid(), pci_bus_id=_PCI_BUS_ID)


@atexit.register
def _restore_at_exit() -> None:
    """Exiting while checkpointed would block in the first CUDA call of PyTorch's own exit handlers."""
    if _CURRENT is not None:
        try:
            restore_process(timeout_s=120)
        except CheckpointError as exc:
            print(f"torpor: could not restore the CUDA context at exit: {exc}", file=sys.stderr)
    if _HELPER is not None:
        _HELPER.stop()
