"""Tensor-parallel worker processes: ranks 1..N-1 of an engine, each with its own ModelRunner and
MemoryManager, driven by rank 0 through one `Pipe` per worker.

Rank 0 sends a pickled `(command, args)`; the worker runs it (the forward passes meet in the layers'
collectives) and answers `("ok", result)` or `("error", exception)`. Commands: run, sleep, wake,
reload_weights, update_weights, exit. `WorkerGroup` is rank 0's side: it starts the workers, sends
commands, and turns a dead worker or a reply that never comes into a clear error instead of a hang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import socket
import time
import traceback
import weakref

import torch
import torch.multiprocessing as mp

from torpor.engine.config import EngineConfig
from torpor.engine.distributed import init_tensor_parallel, shutdown_tensor_parallel


class RankError(RuntimeError):
    """A command failed on one rank; `cause` is that rank's exception (type kept when it pickles)."""

    def __init__(self, rank: int, cause: BaseException, detail: str = "") -> None:
        super().__init__(f"tensor-parallel rank {rank}: {type(cause).__name__}: {cause}{detail}")
        self.rank, self.cause = rank, cause


class WorkerDiedError(RuntimeError):
    """A worker process exited, or did not answer in time; the engine cannot run any more."""


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config of one rank: on GPU, rank r uses the device r places after rank 0's."""
    if not config.device.startswith("cuda"):
        return config
    first = int(config.device.partition(":")[2] or 0)
    return dataclasses.replace(config, device=f"cuda:{first + rank}")


# ---- the worker process ------------------------------------------------------------------------
def worker_main(rank: int, size: int, config: EngineConfig, init_method: str, memory_options: dict | None,
                conn) -> None:
    """Entry point of rank `rank` (a spawned process): start up, then serve rank 0's commands."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off (see docs/tensor-parallel.md)
    if not config.device.startswith("cuda"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))  # the ranks share the cores
    try:
        from torpor.engine.model_runner import ModelRunner

        init_tensor_parallel(rank, size, init_method, torch.device(config.device), config.tp_timeout_s)
        memory = None
        if memory_options is not None:
            from torpor.memory import MemoryManager

            memory = MemoryManager(config.device, **memory_options)
        runner = ModelRunner(config, memory)
    except BaseException as e:
        _reply_error(conn, e)
        return
    conn.send(("ok", None))
    _serve(runner, memory, conn)
    shutdown_tensor_parallel()


def _serve(runner, memory, conn) -> None:
    while True:
        try:
            command, args = conn.recv()
        except (EOFError, OSError):  # rank 0 is gone
            return
        if command == "exit":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", _handle(runner, memory, command, args)))
        except Exception as e:
            _reply_error(conn, e)


def _handle(runner, memory, command: str, args: tuple):
    if command == "run":
        with torch.inference_mode():
            runner.compute_logits(*args)  # rank 0 samples from the gathered logits
        return None
    if command == "sleep":
        memory.sleep(*args)
        if runner.device.type == "cuda":
            torch.cuda.empty_cache()
        return None
    if command == "wake":
        memory.wake(*args)
        return None
    if command == "reload_weights":
        return runner.reload_weights(*args)
    if command == "update_weights":
        return runner.update_weights(*args)
    raise ValueError(f"unknown worker command {command!r}")


def _reply_error(conn, error: BaseException) -> None:
    detail = "".join(traceback.format_exception(error))
    try:
        pickle.dumps(error)
    except Exception:
        error = RuntimeError(f"{type(error).__name__}: {error}")
    conn.send(("error", (error, detail)))


# ---- rank 0's side -----------------------------------------------------------------------------
class WorkerGroup:
    """Ranks 1..size-1 as spawned processes; rank 0 (this process) joins the same process group."""

    def __init__(self, config: EngineConfig, memory_options: dict[int, dict] | None) -> None:
        """`memory_options`: None = no MemoryManager on the workers; else rank -> MemoryManager kwargs."""
        self.size, self.timeout_s = config.tensor_parallel_size, config.tp_timeout_s
        self.broken: str | None = None
        if torch.distributed.is_initialized():
            raise RuntimeError("this process already belongs to a process group (another tensor-parallel engine?): "
                               "close() it first; one tensor-parallel engine per process")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before any NCCL communicator exists
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self.processes, self.conns = [], []
        for rank in range(1, self.size):
            parent, child = ctx.Pipe()
            options = None if memory_options is None else dict(memory_options.get(rank, {}))
            process = ctx.Process(target=worker_main, name=f"torpor-tp-rank{rank}", daemon=True,
                                  args=(rank, self.size, rank_config(config, rank), init_method, options, child))
            process.start()
            child.close()
            self.processes.append(process)
            self.conns.append(parent)
        self._finalizer = weakref.finalize(self, _shutdown, self.processes, self.conns)
        init_tensor_parallel(0, self.size, init_method, torch.device(config.device), self.timeout_s)

    def send(self, command: str, *args, ranks: list[int] | None = None) -> None:
        self.check_usable()
        for rank in ranks or range(1, self.size):
            self.conns[rank - 1].send((command, args))

    def collect(self, what: str, ranks: list[int] | None = None) -> tuple[dict[int, object], dict[int, RankError]]:
        """Every worker's reply: (results, errors) by rank. Raises WorkerDiedError when a worker exits
        or stays silent past the timeout (the group is then unusable)."""
        results, errors = {}, {}
        for rank in ranks or range(1, self.size):
            status, value = self._reply(rank, what)
            if status == "ok":
                results[rank] = value
            else:
                error, detail = value
                errors[rank] = RankError(rank, error, f"\n--- rank {rank} traceback ---\n{detail}")
        return results, errors

    def _reply(self, rank: int, what: str):
        conn, process = self.conns[rank - 1], self.processes[rank - 1]
        deadline = time.monotonic() + self.timeout_s
        while not conn.poll(0.05):
            if not process.is_alive():
                self._break(f"tensor-parallel rank {rank} (pid {process.pid}) died during {what} "
                            f"(exit code {process.exitcode})")
            if time.monotonic() > deadline:
                self._break(f"tensor-parallel rank {rank} (pid {process.pid}) did not answer {what} within "
                            f"{self.timeout_s:.0f} s (tp_timeout_s)")
        try:
            return conn.recv()
        except (EOFError, OSError):
            self._break(f"tensor-parallel rank {rank} (pid {process.pid}) closed its pipe during {what}")

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
        self.broken = reason
        raise WorkerDiedError(reason)

    def close(self) -> None:
        """Ask the workers to exit, then make sure they did; leave the process group."""
        self._finalizer()
        shutdown_tensor_parallel()


def _shutdown(processes, conns) -> None:
    for conn, process in zip(conns, processes, strict=True):
        if process.is_alive():
            with contextlib.suppress(OSError, ValueError):
                conn.send(("exit", ()))
    for conn, process in zip(conns, processes, strict=True):
        process.join(timeout=10)
        if process.is_alive():
            process.terminate()
            process.join(timeout=5)
        conn.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
