"""Tensor-parallel worker processes: ranks 1..N-1 of an engine, each with its own ModelRunner and
MemoryManager, driven by rank 0 through one `Pipe` per worker.

Rank 0 sends a pickled `(command, args)`; the worker runs it (the forward passes meet in the layers'
collectives) and answers `("ok", result)` or `("error", exception)`. Commands: run, sleep, wake,
reload_weights, update_weights (the tensors follow through the process group, see `receive_tensors`), reset_buffers,
info, exit. Rank 0's side, `WorkerGroup`, is in worker_group.py.

Workers ignore SIGINT (Ctrl-C reaches the whole process group of a terminal; rank 0 alone decides when
the workers stop) and exit on their own when rank 0 goes away.
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
from dataclasses import asdict

import torch

from torpor.engine.config import EngineConfig
from torpor.engine.distributed import (
    broadcast_from_rank0,
    check_exchange,
    check_in,
    init_tensor_parallel,
    release_exchange,
    rendezvous_store,
    restore_exchange,
    shutdown_tensor_parallel,
    tp_rank,
)

TEARDOWN_TIMEOUT_S = 60.0  # leaving the process group together (a healthy close) takes well under this


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config of one rank: on GPU, rank r uses the device r places after rank 0's."""
    if not config.device.startswith("cuda"):
        return config
    first = int(config.device.partition(":")[2] or 0)
    return dataclasses.replace(config, device=f"cuda:{first + rank}")


def rank_info(runner, memory) -> dict:
    """This rank's device, its memory in use (the whole device, as `MemoryManager.device_used_bytes`;
    CPU: the process's RSS), its tags and how many CUDA graphs it holds."""
    if memory is not None:
        used, tags = memory.device_used_bytes(), {tag: asdict(u) for tag, u in memory.usage().items()}
    else:
        from torpor.memory import device_used_bytes

        used, tags = device_used_bytes(runner.device), {}
    graphs = runner.graphs.graphs if runner.graphs is not None else {}
    return {"rank": tp_rank(), "pid": os.getpid(), "device": str(runner.device), "device_used_bytes": used,
            "cuda_graphs": len(graphs), "tags": tags}


# ---- the worker process ------------------------------------------------------------------------
def worker_main(rank: int, size: int, config: EngineConfig, store_port: int, memory_options: dict | None,
                conn) -> None:
    """Entry point of rank `rank` (a spawned process): start up, then serve rank 0's commands."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    _exit_with_parent(os.getppid())
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # inherited from rank 0, which set it (docs/tensor-parallel.md)
    if not config.device.startswith("cuda"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))  # the ranks share the cores
    try:
        from torpor.engine.model_runner import ModelRunner

        store = rendezvous_store(store_port, size, False, config.tp_timeout_s)
        check_in(store, rank)
        init_tensor_parallel(rank, size, store, torch.device(config.device), config.tp_timeout_s)
        memory = None
        if memory_options is not None:
            from torpor.memory import MemoryManager

            memory = MemoryManager(config.device, **memory_options)
        runner = ModelRunner(config, memory)
    except BaseException as e:
        with contextlib.suppress(OSError):
            _reply_error(conn, e)
        os._exit(1)  # without leaving the group: the others may be anywhere (a collective teardown would hang)
    try:
        conn.send(("ok", None))
    except OSError:
        os._exit(0)  # rank 0 is gone
    end = _serve(runner, memory, conn)
    if end != "exit":
        # Rank 0 is gone, or a step failed here (the ranks' collectives may be out of step: this engine
        # cannot run any more; rank 0 sees this process die). No (collective) teardown of the group.
        os._exit(0 if end == "gone" else 1)
    try:
        runner.close()  # its graphs (they captured NCCL calls) go before the communicator
    finally:
        left = shutdown_tensor_parallel(healthy=True, timeout_s=TEARDOWN_TIMEOUT_S)  # with rank 0 (see close)
    os._exit(0 if left else 1)  # nothing left to do; no interpreter teardown (CUDA / NCCL finalizers)


def _exit_with_parent(parent_pid: int) -> None:
    """Exit when rank 0 dies, even while blocked in a collective that will never complete."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="torpor-tp-parent-watch", daemon=True).start()


def _serve(runner, memory, conn) -> str:
    """Rank 0's commands until "exit"; returns "exit", "gone" (rank 0 is) or "failed" (a step failed)."""
    while True:
        try:
            command, args = conn.recv()
        except (EOFError, OSError):
            return "gone"
        try:
            if command == "exit":
                conn.send(("ok", None))
                return "exit"
            try:
                reply = ("ok", _handle(runner, memory, conn, command, args))
            except Exception as e:
                _reply_error(conn, e)
                if command == "run":
                    return "failed"
            else:
                conn.send(reply)
        except (EOFError, OSError):
            return "gone"


def _handle(runner, memory, conn, command: str, args: tuple):
    if command == "run":
        (batch,) = args  # a StepBatch
        with torch.inference_mode():
            runner.compute_logits(batch.sequences(), batch.is_prefill)  # rank 0 samples from the gathered logits
        check_exchange()
        return None
    if command == "sleep":
        sleep_rank(memory, *args)
        return None
    if command == "wake":
        wake_rank(memory, *args)
        return None
    if command == "reload_weights":
        return runner.reload_weights(*args)
    if command == "update_weights":
        strict, reset_buffers = args
        tensors = receive_tensors(conn, runner.device)
        try:
            return runner.update_weights(tensors, strict, reset_buffers)
        finally:
            for _ in tensors:  # after a failure here: meet rank 0's remaining broadcasts until its "end"
                pass
    if command == "reset_buffers":
        return runner.reset_buffers()
    if command == "info":
        return rank_info(runner, memory)
    if command == "weights_group":  # a trainer's weights update group (weight_transfer.rank_command)
        from torpor.engine.weight_transfer import rank_command

        return rank_command(runner, *args)
    raise ValueError(f"unknown worker command {command!r}")


def sleep_rank(memory, actions):
    """One rank's part of a sleep: the exchange buffer first (every rank releases it, whatever happens next:
    a failed sleep is rolled back by a wake on every rank, which maps it again everywhere), then the tags."""
    if actions:
        release_exchange()
    report = memory.sleep(actions)
    if memory.device.type == "cuda":
        torch.cuda.empty_cache()
    return report


def wake_rank(memory, tags):
    """One rank's part of a wake: the exchange buffer (a collective with the other ranks), then the tags."""
    restore_exchange()
    return memory.wake(tags)


def _reply_error(conn, error: BaseException) -> None:
    detail = "".join(traceback.format_exception(error))
    try:
        pickle.dumps(error)
    except Exception:
        error = RuntimeError(f"{type(error).__name__}: {error}")
    conn.send(("error", (error, detail)))


# ---- weights from rank 0, through the process group --------------------------------------------
# `update_weights` streams: for every tensor rank 0 sends its (name, shape, dtype) through each pipe and
# broadcasts the data over the process group (NCCL on GPU: device to device, no host copy, no shared
# memory; one tensor at a time on each device); ("end",) closes the stream.

def receive_tensors(conn, device: torch.device):
    """A worker: yields (name, tensor on `device`) for every tensor rank 0 sends, until its "end"."""
    while True:
        message = conn.recv()
        if message[0] == "end":
            return
        _, name, shape, dtype = message
        yield name, broadcast_from_rank0(torch.empty(shape, dtype=dtype, device=device))
