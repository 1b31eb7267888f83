"""How an engine reaches its ranks: `make_executor` picks the kind (executor/base.py says what one does)."""

from __future__ import annotations

from torpor.engine.config import EngineConfig
from torpor.engine.executor.base import Executor, RankError, WorkerDiedError, with_extension
from torpor.engine.executor.inproc import InProcExecutor
from torpor.engine.executor.multiproc import MultiprocExecutor
from torpor.engine.worker import Worker


def make_executor(config: EngineConfig, memory=None, worker_memory_options: dict[int, dict] | None = None,
                  worker_cls: type[Worker] = Worker) -> Executor:
    """One rank: its Worker here; several: a process per rank besides this one (rank 0). The worker extension of
    `config` (worker_extension_cls) is mixed into `worker_cls` in every rank's process (`with_extension`)."""
    if config.tensor_parallel_size == 1:
        return InProcExecutor(config, memory, with_extension(worker_cls, config.worker_extension_cls))
    return MultiprocExecutor(config, memory, worker_memory_options, worker_cls)


__all__ = ["Executor", "InProcExecutor", "MultiprocExecutor", "RankError", "WorkerDiedError", "make_executor",
           "with_extension"]
