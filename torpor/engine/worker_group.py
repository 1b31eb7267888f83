"""Rank 0's side of tensor parallelism: `WorkerGroup` starts ranks 1..N-1 as spawned processes (see
worker.py), sends them commands through one `Pipe` each, and turns a dead worker or a reply that never
comes into a clear error instead of a hang; rank 0's half of the weight stream of `update_weights`."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref

import torch
import torch.multiprocessing as mp

from torpor.engine.config import EngineConfig
from torpor.engine.distributed import (
    abort_if_nccl,
    broadcast_from_rank0,
    checked_in,
    init_tensor_parallel,
    rendezvous_store,
    shutdown_tensor_parallel,
)
from torpor.engine.worker import TEARDOWN_TIMEOUT_S, rank_config, worker_main


class RankError(RuntimeError):
    """A command failed on one rank; `cause` is that rank's exception (type kept when it pickles)."""

    def __init__(self, rank: int, cause: BaseException, detail: str = "") -> None:
        super().__init__(f"tensor-parallel rank {rank}: {type(cause).__name__}: {cause}{detail}")
        self.rank, self.cause = rank, cause


class WorkerDiedError(RuntimeError):
    """A worker process exited, or did not answer in time; the engine cannot run any more."""


def check_devices(config: EngineConfig) -> None:
    """On GPU, raise before any process starts unless the devices of every rank are visible."""
    if not config.device.startswith("cuda"):
        return
    first = int(config.device.partition(":")[2] or 0)
    last, count = first + config.tensor_parallel_size - 1, torch.cuda.device_count()
    if last >= count:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} on {config.device} needs devices "
                         f"cuda:{first}..cuda:{last} (one per rank), but {count} CUDA device(s) are visible "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")


def send_tensors(conns, named_tensors, device: torch.device):
    """Rank 0: yields (name, tensor on `device`) while every worker receives the same tensor."""
    for name, tensor in named_tensors:
        tensor = tensor.detach().to(device).contiguous()
        for conn in conns:
            conn.send(("tensor", name, tuple(tensor.shape), tensor.dtype))
        yield name, broadcast_from_rank0(tensor)


def end_tensors(conns) -> None:
    """Rank 0: the stream is over (also after a failure on rank 0: the workers stop receiving)."""
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send(("end",))


# ---- rank 0's side -----------------------------------------------------------------------------
class WorkerGroup:
    """Ranks 1..size-1 as spawned processes; rank 0 (this process) joins the same process group."""

    def __init__(self, config: EngineConfig, memory_options: dict[int, dict] | None) -> None:
        """`memory_options`: None = no MemoryManager on the workers; else rank -> MemoryManager kwargs."""
        self.size, self.timeout_s = config.tensor_parallel_size, config.tp_timeout_s
        if torch.distributed.is_initialized():
            raise RuntimeError("this process already belongs to a process group (another tensor-parallel engine?): "
                               "close() it first; one tensor-parallel engine per process")
        check_devices(config)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before any NCCL communicator exists; workers inherit it
        store = rendezvous_store(0, self.size, True, self.timeout_s)
        ctx = mp.get_context("spawn")
        self.processes, self.conns = [], []
        self._state: dict = {"broken": None, "closing": False, "aborted": False}  # shared: finalizer, watch
        self._finalizer = weakref.finalize(self, _shutdown, self.processes, self.conns, self._state)
        try:
            for rank in range(1, self.size):
                parent, child = ctx.Pipe()
                options = None if memory_options is None else dict(memory_options.get(rank, {}))
                process = ctx.Process(target=worker_main, name=f"torpor-tp-rank{rank}", daemon=True,
                                      args=(rank, self.size, rank_config(config, rank), store.port, options, child))
                process.start()
                child.close()
                self.processes.append(process)
                self.conns.append(parent)
            self._wait_for_check_in(store)
            init_tensor_parallel(0, self.size, store, torch.device(config.device), self.timeout_s)
        except BaseException:
            self.close(healthy=False)
            raise
        threading.Thread(target=_watch_workers, args=(self.processes, self._state), name="torpor-tp-watch",
                         daemon=True).start()

    def _wait_for_check_in(self, store) -> None:
        """Wait until every worker reached the store; a worker that exits first fails start-up at once
        (not after the rendezvous timeout), with its exit code and the likely cause."""
        deadline = time.monotonic() + self.timeout_s
        while not checked_in(store, range(1, self.size)):
            for rank, process in enumerate(self.processes, start=1):
                if not process.is_alive():
                    reported = self.early_errors(wait_s=0.0)  # a worker that failed in worker_main said why
                    if reported:
                        raise reported[min(reported)]
                    raise WorkerDiedError(
                        f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.exitcode} "
                        f"while starting, before joining the process group. Workers are started with the "
                        f"'spawn' method, which re-imports your main module: if your script creates the LLM at "
                        f"its top level, wrap that code in `if __name__ == \"__main__\":`")
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"the tensor-parallel workers did not start within {self.timeout_s:.0f} s")
            time.sleep(0.05)

    @property
    def broken(self) -> str | None:
        """Why the group cannot be used any more (None while it can)."""
        return self._state["broken"]

    def send(self, command: str, *args, ranks: list[int] | None = None) -> None:
        self.check_usable()
        for rank in ranks or range(1, self.size):
            self.conns[rank - 1].send((command, args))

    def collect(self, what: str, ranks: list[int] | None = None,
                timeout_s: float | None = None) -> tuple[dict[int, object], dict[int, RankError]]:
        """Every worker's reply: (results, errors) by rank. Raises WorkerDiedError when a worker exits
        or stays silent past `timeout_s` (default tp_timeout_s; the group is then unusable)."""
        results, errors = {}, {}
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        for rank in ranks or range(1, self.size):
            status, value = self._reply(rank, what, deadline)
            if status == "ok":
                results[rank] = value
            else:
                error, detail = value
                errors[rank] = RankError(rank, error, f"\n--- rank {rank} traceback ---\n{detail}")
        return results, errors

    def _reply(self, rank: int, what: str, deadline: float):
        conn, process = self.conns[rank - 1], self.processes[rank - 1]
        waited = time.monotonic()
        while not conn.poll(0.05):
            if not process.is_alive():
                self._break(f"tensor-parallel rank {rank} (pid {process.pid}) died during {what} "
                            f"(exit code {process.exitcode})")
            if time.monotonic() > deadline:
                self._break(f"tensor-parallel rank {rank} (pid {process.pid}) did not answer {what} within "
                            f"{time.monotonic() - waited:.0f} s")
        try:
            return conn.recv()
        except (EOFError, OSError):
            self._break(f"tensor-parallel rank {rank} (pid {process.pid}) closed its pipe during {what}")

    def early_errors(self, wait_s: float = 2.0) -> dict[int, RankError]:
        """The errors workers already reported or report within `wait_s` (a failed start-up), by rank."""
        errors, deadline = {}, time.monotonic() + wait_s
        for rank, conn in enumerate(self.conns, start=1):
            try:
                if conn.poll(max(0.0, deadline - time.monotonic())):
                    status, value = conn.recv()
                    if status == "error":
                        error, detail = value
                        errors[rank] = RankError(rank, error, f"\n--- rank {rank} traceback ---\n{detail}")
            except (EOFError, OSError):
                pass
        return errors

    def dead_workers(self) -> list[str]:
        return [f"rank {i + 1} (pid {p.pid}, exit code {p.exitcode})"
                for i, p in enumerate(self.processes) if not p.is_alive()]

    def check_usable(self) -> None:
        if self.broken is not None:
            raise WorkerDiedError(f"the tensor-parallel engine is unusable: {self.broken}")
        dead = self.dead_workers()
        if dead:
            self._break(f"worker process(es) died: {', '.join(dead)}")

    def _break(self, reason: str):
        self._state["broken"] = reason
        raise WorkerDiedError(reason)

    def close(self, healthy: bool = True) -> None:
        """Stop the workers and leave the process group (once; later calls do nothing).

        Healthy (every worker alive and idle): the workers are told to exit and every rank, this one
        included, leaves the group at the same time (NCCL's teardown is collective across the ranks).
        Otherwise (a worker died or hangs, or start-up failed: `healthy=False`) the workers are killed
        first and this rank's communicator is aborted."""
        if not healthy and self._state["broken"] is None:
            self._state["broken"] = "its start-up failed"
        self._finalizer()


def _watch_workers(processes, state: dict) -> None:
    """Rank 0's watch over its workers, for the group's life: a worker that dies breaks the group and,
    on NCCL, aborts rank 0's communicator. NCCL never notices a dead peer on the same host; a collective
    rank 0 is blocked in (a start-up collective while a worker fails to load, a step while a worker is
    killed) would wait for tp_timeout_s, then PyTorch's watchdog would end the whole process."""
    while not state["closing"]:
        dead = [f"rank {i + 1} (pid {p.pid}, exit code {p.exitcode})" for i, p in enumerate(processes)
                if not p.is_alive()]
        if dead and not state["closing"]:
            if state["broken"] is None:
                state["broken"] = f"worker process(es) died: {', '.join(dead)}"
            state["aborted"] = abort_if_nccl()
            return
        time.sleep(0.1)


def _shutdown(processes, conns, state: dict) -> None:
    state["closing"] = True
    healthy = state["broken"] is None and all(p.is_alive() for p in processes)
    if healthy:
        for conn in conns:
            try:
                conn.send(("exit", ()))
            except (OSError, ValueError):
                healthy = False
    if healthy:
        shutdown_tensor_parallel(healthy=True, timeout_s=TEARDOWN_TIMEOUT_S)  # meets the workers' own teardown
        for process in processes:
            process.join(timeout=30)
    for process in processes:  # not healthy, or a worker that did not exit
        if process.is_alive():
            process.kill()
            process.join(timeout=10)
    if not healthy:
        shutdown_tensor_parallel(healthy=False, timeout_s=30)
    for conn in conns:
        conn.close()
    if state["broken"] is None:
        state["broken"] = "it was closed"

