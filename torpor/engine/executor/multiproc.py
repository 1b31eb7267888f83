"""`MultiprocExecutor`: a tensor-parallel engine, one process per rank. Rank 0's Worker (the driver) runs in the
engine's process; ranks 1..N-1 are spawned processes, each with its own Worker, driven through one `Pipe` each.

A call goes to the workers first, then runs on the driver, then waits for every reply, so it returns when every
rank finished; a failure on any rank raises that rank's error (`RankError`, with its rank). A worker that dies
or stops answering within `tp_timeout_s` makes the engine unusable (`WorkerDiedError`; `health()` says why): a
watch thread notices a dead or stopped worker even while the engine is idle, and on NCCL aborts rank 0's
communicator so nothing waits for a peer that is gone.

Workers ignore SIGINT (Ctrl-C reaches the whole process group of a terminal; rank 0 alone decides when the
workers stop) and exit on their own when rank 0 goes away.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Iterable, Mapping

import cloudpickle
import torch
import torch.multiprocessing as mp

from torpor.engine.config import EngineConfig
from torpor.engine.distributed import TPGroup, check_divisible, rendezvous_store
from torpor.engine.executor.base import Executor, Method, RankError, WorkerDiedError, bound, with_extension
from torpor.engine.models import ModelConfig
from torpor.engine.sampler import SamplerOutput
from torpor.engine.sequence import Sequence
from torpor.engine.step_batch import StepBatch
from torpor.engine.worker import Worker
from torpor.memory import MemoryManager

TEARDOWN_TIMEOUT_S = 60.0  # leaving the process group together (a healthy close) takes well under this
STEP_FAILURE_WAIT_S = 10.0  # a step failed on rank 0: how long the workers may take to answer it


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config of one rank: on GPU, rank r uses the device r places after rank 0's."""
    if not config.device.startswith("cuda"):
        return config
    first = int(config.device.partition(":")[2] or 0)
    return dataclasses.replace(config, device=f"cuda:{first + rank}")


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


class MultiprocExecutor(Executor):
    """`memory`: rank 0's MemoryManager (None: no sleep mode on any rank); `worker_memory_options`: rank ->
    MemoryManager keyword arguments of that worker (e.g. a per-rank `max_host_bytes`)."""

    def __init__(self, config: EngineConfig, memory=None, worker_memory_options: dict[int, dict] | None = None,
                 worker_cls: type[Worker] = Worker) -> None:
        check_divisible(ModelConfig.from_pretrained(config.model), config.tensor_parallel_size)
        check_devices(config)
        self.world_size, self.timeout_s = config.tensor_parallel_size, config.tp_timeout_s
        device = torch.device(config.device)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before any NCCL communicator exists; workers inherit it
        store = rendezvous_store(0, self.world_size, True, self.timeout_s)
        options = None if memory is None else (worker_memory_options or {})
        ctx = mp.get_context("spawn")
        self.processes, self.conns = [], []
        # Shared with the finalizer and the watch thread (neither may hold the executor itself).
        self._state: dict = {"broken": None, "closing": False, "stopped_since": {}, "group": None, "driver": None}
        self._finalizer = weakref.finalize(self, _shutdown, self.processes, self.conns, self._state)
        try:
            for rank in range(1, self.world_size):
                parent, child = ctx.Pipe()
                rank_options = None if options is None else dict(options.get(rank, {}))
                process = ctx.Process(target=worker_main, name=f"torpor-tp-rank{rank}", daemon=True,
                                      args=(rank, self.world_size, rank_config(config, rank), store.port,
                                            rank_options, worker_cls, child))
                process.start()
                child.close()
                self.processes.append(process)
                self.conns.append(parent)
            self._wait_for_check_in(store)
            self._state["group"] = TPGroup.join(0, self.world_size, store, device, config.tp_comm, self.timeout_s)
            # The driver meets the workers' start-up in its collectives.
            self.driver = self._state["driver"] = with_extension(worker_cls, config.worker_extension_cls)(
                config, self._state["group"], memory)
            _, errors = self._collect("start-up")
            if errors:
                raise errors[min(errors)]
        except BaseException as e:
            # A worker that failed first explains it best (rank 0 then fails in a collective with it).
            errors = self._early_errors() if isinstance(e, Exception) else {}
            self._state["broken"] = "its start-up failed"
            self._finalizer()  # workers may be blocked in a start-up collective
            if errors:
                raise errors[min(errors)] from e
            raise
        threading.Thread(target=_watch_workers, args=(self.processes, self._state, self.timeout_s),
                         name="torpor-tp-watch", daemon=True).start()

    # ---- calls -----------------------------------------------------------------------------------
    def collective_rpc(self, method: Method, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list:
        """A callable travels to the workers by value, as vLLM sends it (cloudpickle: a lambda or a function of
        the caller's script too; the pipe joins this process and the workers it spawned)."""
        sent = cloudpickle.dumps(method) if callable(method) else method
        results, errors = self._everywhere(("call", sent, args, kwargs or {}), bound(self.driver, method), args,
                                           kwargs or {}, timeout, what=getattr(method, "__name__", method))
        if errors:
            raise errors[min(errors)]  # rank 0's own exception as is, a worker's as a RankError
        return results

    def _everywhere(self, message: tuple, local, args: tuple, kwargs: dict, timeout: float | None, what: str,
                    failed_here_wait_s: float | None = None) -> tuple[list, dict[int, BaseException]]:
        """Send `message` to the workers, run `local(*args, **kwargs)` here, wait for everyone: the results in rank
        order and the errors by rank (rank 0's included)."""
        self._send(message)
        result, errors = None, {}
        try:
            result = local(*args, **kwargs)
        except Exception as e:
            errors[0] = e
        wait = failed_here_wait_s if errors and failed_here_wait_s is not None else timeout
        try:
            results, worker_errors = self._collect(what, wait)
        except WorkerDiedError as died:
            raise died from errors.get(0)
        errors.update(worker_errors)
        return [result] + [results.get(rank) for rank in range(1, self.world_size)], errors

    def execute_model(self, seqs: list[Sequence], is_prefill: bool) -> SamplerOutput:
        """One step on every rank. A step that fails on any rank leaves the engine unusable (the ranks'
        collectives may be out of step): a worker exits after replying its error; a failure here waits
        STEP_FAILURE_WAIT_S for the workers, then gives them up."""
        results, errors = self._everywhere(("call", "execute_batch", (StepBatch.pack(seqs, is_prefill),), {}),
                                           self.driver.execute_model, (seqs, is_prefill), {}, None, "a step",
                                           failed_here_wait_s=STEP_FAILURE_WAIT_S)
        if errors:
            _break(self._state, f"a step failed on rank {min(errors)}: {errors[min(errors)]}")
            raise errors[min(errors)]
        return results[0]

    def sleep(self, actions: Mapping[str, str]):
        """All or nothing: a sleep that fails on any rank is rolled back on the others (they wake again; weights
        it discarded come back from the checkpoint), so no rank stays half asleep."""
        results, errors = self._everywhere(("call", "sleep", (dict(actions),), {}), self.driver.sleep,
                                           (dict(actions),), {}, None, "sleep")
        if errors:
            tags = list(actions)
            self._everywhere(("call", "wake", (tags,), {}), self.driver.wake, (tags,), {}, None, "a roll-back wake")
            if actions.get("weights") == "discard":
                self.collective_rpc("reload_weights", (self.driver.config.model,))
            first = min(errors)
            raise errors[first] if first else RankError(0, errors[0])
        return results[0]

    def wake(self, tags: Iterable[str] | None):
        tags = None if tags is None else list(tags)
        return self.collective_rpc("wake", (tags,))[0]

    def load_weights(self, named_tensors, strict: bool, reset_buffers: bool = True, staged: bool = False) -> int:
        """Every rank receives every tensor (it keeps its shard), streamed one at a time: its name through the pipes,
        its data broadcast over the group from rank 0's device. A list is checked whole before any rank writes."""
        if isinstance(named_tensors, list | tuple):
            self.driver.check_update(named_tensors, strict, staged)

        def local() -> int:
            try:
                return self.driver.load_weights(self._send_tensors(named_tensors), strict, reset_buffers)
            finally:
                for conn in self.conns:  # the stream is over (also after a failure here: the workers stop)
                    with contextlib.suppress(OSError):
                        conn.send(("end",))

        results, errors = self._everywhere(("stream_weights", strict, reset_buffers), local, (), {}, None,
                                           "update_weights")
        if errors:
            raise errors[min(errors)]
        return results[0]

    def _send_tensors(self, named_tensors):
        for name, tensor in named_tensors:
            tensor = tensor.detach().to(self.driver.device).contiguous()
            for conn in self.conns:
                conn.send(("tensor", name, tuple(tensor.shape), tensor.dtype))
            yield name, self.driver.group.broadcast(tensor)

    # ---- the workers -----------------------------------------------------------------------------
    def broken(self) -> str | None:
        return self._state["broken"]

    def health(self) -> str | None:
        if self._state["broken"] is not None:
            return self._state["broken"]
        stopped = self._state["stopped_since"]
        if stopped:
            return "; ".join(f"tensor-parallel rank {rank} (pid {self.processes[rank - 1].pid}) is stopped "
                             f"(SIGSTOP?) since {time.monotonic() - since:.0f} s" for rank, since in stopped.items())
        return None

    def _send(self, message: tuple) -> None:
        self._check_usable()
        for conn in self.conns:
            conn.send(message)

    def _check_usable(self) -> None:
        if self._state["broken"] is not None:
            raise WorkerDiedError(f"the tensor-parallel engine is unusable: {self._state['broken']}")
        dead = _dead(self.processes)
        if dead:
            self._break(f"worker process(es) died: {', '.join(dead)}")

    def _collect(self, what: str, timeout_s: float | None = None) -> tuple[dict[int, object], dict[int, RankError]]:
        """Every worker's reply: (results, errors) by rank. Raises WorkerDiedError when a worker exits or stays
        silent past `timeout_s` (default tp_timeout_s; the engine is then unusable)."""
        results, errors = {}, {}
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        for rank in range(1, self.world_size):
            status, value = self._reply(rank, what, deadline, limit)
            if status == "ok":
                results[rank] = value
            else:
                error, detail = value
                errors[rank] = RankError(rank, error, f"\n--- rank {rank} traceback ---\n{detail}")
        return results, errors

    def _reply(self, rank: int, what: str, deadline: float, limit: float):
        conn, process = self.conns[rank - 1], self.processes[rank - 1]
        while not conn.poll(0.05):
            if not process.is_alive():
                self._break(f"tensor-parallel rank {rank} (pid {process.pid}) died during {what} "
                            f"(exit code {process.exitcode})")
            if time.monotonic() > deadline:
                self._break(f"tensor-parallel rank {rank} (pid {process.pid}) did not answer {what} within "
                            f"{limit:g} s")
        try:
            return conn.recv()
        except (EOFError, OSError):
            self._break(f"tensor-parallel rank {rank} (pid {process.pid}) closed its pipe during {what}")

    def _break(self, reason: str):
        _break(self._state, reason)
        raise WorkerDiedError(reason)

    def _wait_for_check_in(self, store) -> None:
        """Wait until every worker reached the store; a worker that exits first fails start-up at once (not after
        the rendezvous timeout), with its exit code and the likely cause."""
        deadline = time.monotonic() + self.timeout_s
        while not store.check([f"torpor-up/{rank}" for rank in range(1, self.world_size)]):
            for rank, process in enumerate(self.processes, start=1):
                if not process.is_alive():
                    reported = self._early_errors(wait_s=0.0)  # a worker that failed in worker_main said why
                    if reported:
                        raise reported[min(reported)]
                    raise WorkerDiedError(
                        f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.exitcode} "
                        f"while starting, before joining the process group. Workers are started with the "
                        f"'spawn' method, which re-imports your main module: if your script creates the LLM at "
                        f"its top level, wrap that code in `if __name__ == \"__main__\":`")
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"the tensor-parallel workers did not start within {self.timeout_s:g} s")
            time.sleep(0.05)

    def _early_errors(self, wait_s: float = 2.0) -> dict[int, RankError]:
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

    def close(self) -> None:
        """Stop the workers and leave the group (once; later calls do nothing). Healthy (every worker alive and
        idle): the workers are told to exit and every rank leaves the group at the same time (NCCL's teardown is
        collective). Otherwise the workers are killed first and this rank's communicator is aborted."""
        self._finalizer()


def _dead(processes) -> list[str]:
    return [f"rank {i + 1} (pid {p.pid}, exit code {p.exitcode})" for i, p in enumerate(processes)
            if not p.is_alive()]


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a debugger): state T in /proc (Linux; False elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def _break(state: dict, reason: str) -> None:
    """The engine is unusable from now on (the first reason stays); nothing waits in a collective for a peer that
    is gone."""
    if state["broken"] is None:
        state["broken"] = reason
        if state["group"] is not None:
            state["group"].abort()


def _watch_workers(processes, state: dict, timeout_s: float) -> None:
    """Rank 0's watch over its workers, for the group's life: a worker that dies breaks the engine (and, on NCCL,
    aborts rank 0's communicator: NCCL never notices a dead peer on the same host); a worker stopped for longer
    than tp_timeout_s breaks it too."""
    stopped = state["stopped_since"]
    while not state["closing"] and state["broken"] is None:
        dead = _dead(processes)
        if dead:
            _break(state, f"worker process(es) died: {', '.join(dead)}")
            return
        for rank, process in enumerate(processes, start=1):
            if not _stopped(process.pid):
                stopped.pop(rank, None)
            elif time.monotonic() - stopped.setdefault(rank, time.monotonic()) > timeout_s:
                _break(state, f"tensor-parallel rank {rank} (pid {process.pid}) was stopped for more than "
                              f"{timeout_s:g} s")
                return
        time.sleep(0.2)


def _shutdown(processes, conns, state: dict) -> None:
    state["closing"] = True
    if state["driver"] is not None:
        state["driver"].close()  # its graphs (they captured the group's collectives) go before the communicator
    group = state["group"]
    healthy = state["broken"] is None and all(p.is_alive() for p in processes)
    if healthy:
        for conn in conns:
            try:
                conn.send(("exit",))
            except (OSError, ValueError):
                healthy = False
    if group is not None and healthy:
        group.shutdown(healthy=True, timeout_s=TEARDOWN_TIMEOUT_S)  # meets the workers' own teardown
        for process in processes:
            process.join(timeout=30)
    for process in processes:  # not healthy, or a worker that did not exit
        if process.is_alive():
            process.kill()
            process.join(timeout=10)
    if group is not None and not healthy:
        group.shutdown(healthy=False, timeout_s=30)
    for conn in conns:
        conn.close()
    if state["broken"] is None:
        state["broken"] = "it was closed"


# ---- the worker process ------------------------------------------------------------------------------
def worker_main(rank: int, size: int, config: EngineConfig, store_port: int, memory_options: dict | None,
                worker_cls: type[Worker], conn) -> None:
    """Entry point of rank `rank` (a spawned process): start up, then serve rank 0's calls."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    _exit_with_parent(os.getppid())
    if not config.device.startswith("cuda"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))  # the ranks share the cores
    try:
        store = rendezvous_store(store_port, size, False, config.tp_timeout_s)
        store.set(f"torpor-up/{rank}", "1")
        group = TPGroup.join(rank, size, store, torch.device(config.device), config.tp_comm, config.tp_timeout_s)
        memory = None if memory_options is None else MemoryManager(config.device, **memory_options)
        worker = with_extension(worker_cls, config.worker_extension_cls)(config, group, memory)
    except BaseException as e:
        with contextlib.suppress(OSError):
            _reply_error(conn, e)
        os._exit(1)  # without leaving the group: the others may be anywhere (a collective teardown would hang)
    try:
        conn.send(("ok", None))
    except OSError:
        os._exit(0)  # rank 0 is gone
    end = _serve(worker, conn)
    if end != "exit":
        # Rank 0 is gone, or a step failed here (the ranks' collectives may be out of step: this engine cannot run
        # any more; rank 0 sees this process die). No (collective) teardown of the group.
        os._exit(0 if end == "gone" else 1)
    try:
        worker.close()
    finally:
        left = group.shutdown(healthy=True, timeout_s=TEARDOWN_TIMEOUT_S)  # with rank 0 (see close)
    os._exit(0 if left else 1)  # nothing left to do; no interpreter teardown (CUDA / NCCL finalizers)


def _exit_with_parent(parent_pid: int) -> None:
    """Exit when rank 0 dies, even while blocked in a collective that will never complete."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="torpor-tp-parent-watch", daemon=True).start()


def _serve(worker: Worker, conn) -> str:
    """Rank 0's calls until "exit"; returns "exit", "gone" (rank 0 is) or "failed" (a step failed)."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return "gone"
        try:
            if message[0] == "exit":
                conn.send(("ok", None))
                return "exit"
            try:
                if message[0] == "stream_weights":
                    _, strict, reset_buffers = message
                    result = _load_streamed(worker, conn, strict, reset_buffers)
                else:
                    _, method, args, kwargs = message
                    if isinstance(method, bytes):  # a callable, by value (collective_rpc)
                        method = pickle.loads(method)
                    result = bound(worker, method)(*args, **kwargs)
            except Exception as e:
                _reply_error(conn, e)
                if message[0] == "call" and message[1] == "execute_batch":
                    return "failed"
            else:
                conn.send(("ok", result))
        except (EOFError, OSError):
            return "gone"


def _load_streamed(worker: Worker, conn, strict: bool, reset_buffers: bool) -> int:
    tensors = _receive_tensors(worker, conn)
    try:
        return worker.load_weights(tensors, strict, reset_buffers)
    finally:
        for _ in tensors:  # after a failure here: meet rank 0's remaining broadcasts until its "end"
            pass


def _receive_tensors(worker: Worker, conn):
    """Yields (name, tensor on this rank's device) for every tensor rank 0 sends, until its "end"."""
    while True:
        message = conn.recv()
        if message[0] == "end":
            return
        _, name, shape, dtype = message
        yield name, worker.group.broadcast(torch.empty(shape, dtype=dtype, device=worker.device))


def _reply_error(conn, error: BaseException) -> None:
    detail = "".join(traceback.format_exception(error))
    try:
        pickle.dumps(error)
    except Exception:
        error = RuntimeError(f"{type(error).__name__}: {error}")
    conn.send(("error", (error, detail)))
