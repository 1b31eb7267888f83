"""The checkpoint helper: a separate process that drives the CUDA driver's checkpoint API on another PID.

Run by `torpor.memory.checkpoint` as `python <this file>` (never imported: it needs neither torch nor
torpor, so it starts in milliseconds and makes no CUDA context of its own). A process cannot checkpoint
itself: called on its own PID from a thread, lock and checkpoint returned and the process made no
further progress (probe on the H200). The helper initializes the driver once (cuInit) and stays up.

Protocol: one JSON object per line on stdin, one JSON reply per line on stdout,
`{"ok": true, ...}` or `{"ok": false, "error": "..."}`. Operations:

    hello                                   pid, driver version, whether the checkpoint API is usable
    state       pid                         "running" | "locked" | "checkpointed" | "failed"
    memory      pid, pci_bus_id             NVML: device total/free/used, the PID's device memory
    checkpoint  pid, pci_bus_id, lock_timeout_ms   lock + checkpoint (unlocks again if the checkpoint fails)
    restore     pid, pci_bus_id, need_bytes        free-memory check, restore, unlock
    recover     pid                         after a failure: restore / unlock until running; the state
"""

from __future__ import annotations

import json
import os
import sys
import time

MIN_DRIVER_VERSION = 12080  # cuCheckpointProcess* arrived with the r570 driver (CUDA 12.8)
_OPS = ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
        "cuCheckpointProcessUnlock", "cuCheckpointProcessGetState", "CUcheckpointLockArgs")
_STATES = {"CU_PROCESS_STATE_RUNNING": "running", "CU_PROCESS_STATE_LOCKED": "locked",
           "CU_PROCESS_STATE_CHECKPOINTED": "checkpointed", "CU_PROCESS_STATE_FAILED": "failed"}


class Driver:
    """cuda.bindings' driver module, initialized once; `problem` says why checkpoints cannot work."""

    def __init__(self) -> None:
        self.cu = None
        self.version = 0
        self.problem: str | None = None
        try:
            from cuda.bindings import driver as cu
        except ImportError:
            self.problem = ("NVIDIA's cuda-bindings is not installed (pip install 'cuda-bindings>=12.8'): "
                            "the checkpoint API is reached through it")
            return
        missing = [name for name in _OPS if not hasattr(cu, name)]
        if missing:
            self.problem = (f"this cuda-bindings ({getattr(cu, '__file__', '?')}) lacks {', '.join(missing)}: "
                            "install cuda-bindings >= 12.8")
            return
        err, = cu.cuInit(0)
        if err != cu.CUresult.CUDA_SUCCESS:
            self.problem = f"cuInit failed: {getattr(err, 'name', err)} (no usable NVIDIA driver)"
            return
        err, self.version = cu.cuDriverGetVersion()
        if self.version < MIN_DRIVER_VERSION:
            self.problem = (f"the NVIDIA driver supports CUDA {self.version // 1000}.{self.version % 1000 // 10}; "
                            "the checkpoint API needs a driver >= 570 (CUDA 12.8)")
            return
        self.cu = cu

    def call(self, name: str, *args):
        if self.cu is None:
            raise RuntimeError(self.problem)
        result = getattr(self.cu, name)(*args)
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{name} failed: {getattr(err, 'name', err)}")
        return values[0] if values else None


class Nvml:
    """Device memory readings through NVML (no CUDA context needed); None where NVML is missing."""

    def __init__(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
        except Exception:  # no nvidia-ml-py, or no driver: readings are then unknown
            self.nvml = None

    def readings(self, pid: int, pci_bus_id: str | None) -> dict:
        if self.nvml is None or not pci_bus_id:
            return {}
        n = self.nvml
        try:  # readings are informative: an NVML failure must not stop a checkpoint or a restore
            handle = n.nvmlDeviceGetHandleByPciBusId(pci_bus_id.encode())
            info = n.nvmlDeviceGetMemoryInfo(handle)
            processes = n.nvmlDeviceGetComputeRunningProcesses(handle)
        except n.NVMLError as exc:
            return {"nvml_error": str(exc)}
        process = sum(int(p.usedGpuMemory or 0) for p in processes if p.pid == pid)
        return {"total_bytes": int(info.total), "free_bytes": int(info.free), "used_bytes": int(info.used),
                "process_bytes": process}


def serve(requests, replies) -> None:
    driver: Driver | None = None
    nvml = Nvml()
    for line in requests:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            op = request["op"]
            if driver is None:
                driver = Driver()
            reply = {"ok": True, **_handle(op, request, driver, nvml)}
        except Exception as exc:
            reply = {"ok": False, "error": str(exc) or type(exc).__name__}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def _handle(op: str, request: dict, driver: Driver, nvml: Nvml) -> dict:
    pid, bus = request.get("pid"), request.get("pci_bus_id")
    if op == "hello":
        return {"pid": os.getpid(), "driver_version": driver.version, "problem": driver.problem}
    if op == "state":
        return {"state": _state(driver, pid)}
    if op == "memory":
        return nvml.readings(pid, bus)
    if op == "checkpoint":
        return _checkpoint(driver, nvml, pid, bus, int(request.get("lock_timeout_ms", 10000)))
    if op == "restore":
        return _restore(driver, nvml, pid, bus, int(request.get("need_bytes", 0)))
    if op == "recover":
        return {"state": _recover(driver, pid)}
    raise ValueError(f"unknown operation {op!r}")


def _state(driver: Driver, pid: int) -> str:
    state = driver.call("cuCheckpointProcessGetState", pid)
    return _STATES.get(getattr(state, "name", ""), str(state))


def _recover(driver: Driver, pid: int) -> str:
    """Bring a process a failed call left checkpointed or locked back to running; its state afterwards."""
    state = _state(driver, pid)
    if state == "checkpointed":
        driver.call("cuCheckpointProcessRestore", pid, None)
        state = _state(driver, pid)
    if state == "locked":
        driver.call("cuCheckpointProcessUnlock", pid, None)
        state = _state(driver, pid)
    return state


def _checkpoint(driver: Driver, nvml: Nvml, pid: int, bus: str | None, lock_timeout_ms: int) -> dict:
    cu = driver.cu
    before = nvml.readings(pid, bus)
    args = cu.CUcheckpointLockArgs()
    args.timeoutMs = lock_timeout_ms
    start = time.perf_counter()
    driver.call("cuCheckpointProcessLock", pid, args)
    locked = time.perf_counter()
    try:
        driver.call("cuCheckpointProcessCheckpoint", pid, None)
    except Exception:
        driver.call("cuCheckpointProcessUnlock", pid, None)  # leave the process running, as before
        raise
    done = time.perf_counter()
    after = nvml.readings(pid, bus)
    held = before.get("process_bytes", 0)
    if "used_bytes" in before and "used_bytes" in after:  # NVML may not list the PID: the device's drop then
        held = max(held, before["used_bytes"] - after["used_bytes"])
    return {"lock_s": locked - start, "checkpoint_s": done - locked, "held_bytes": held,
            "before": before, "after": after}


def _restore(driver: Driver, nvml: Nvml, pid: int, bus: str | None, need_bytes: int) -> dict:
    now = nvml.readings(pid, bus)
    if "free_bytes" in now and need_bytes and now["free_bytes"] < need_bytes:
        # A restore that runs out of device memory can leave the process stuck (NVIDIA's tracker): refuse.
        raise MemoryError(f"restoring the CUDA context needs {need_bytes / 2**20:.0f} MiB of device memory and "
                          f"{now['free_bytes'] / 2**20:.0f} MiB are free; the process stays checkpointed: "
                          "free device memory and wake again")
    start = time.perf_counter()
    driver.call("cuCheckpointProcessRestore", pid, None)
    restored = time.perf_counter()
    driver.call("cuCheckpointProcessUnlock", pid, None)
    return {"restore_s": restored - start, "unlock_s": time.perf_counter() - restored}


if __name__ == "__main__":
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever a library prints must not corrupt the protocol
    serve(sys.stdin, out)
