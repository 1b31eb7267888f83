"""`InProcExecutor`: an engine of one rank, its Worker in the engine's own process (no process group)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torpor.engine.config import EngineConfig
from torpor.engine.distributed import TPGroup
from torpor.engine.executor.base import Executor, Method, bound
from torpor.engine.sampler import SamplerOutput
from torpor.engine.sequence import Sequence
from torpor.engine.worker import Worker


class InProcExecutor(Executor):
    def __init__(self, config: EngineConfig, memory=None, worker_cls: type[Worker] = Worker) -> None:
        self.world_size = 1
        self.driver = worker_cls(config, TPGroup(), memory)
        self._closed = False

    def collective_rpc(self, method: Method, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list:
        """(`timeout` bounds nothing here: the call runs in this thread.)"""
        return [bound(self.driver, method)(*args, **(kwargs or {}))]

    def execute_model(self, seqs: list[Sequence], is_prefill: bool) -> SamplerOutput:
        if self._closed:
            raise RuntimeError("the engine was closed: it cannot run any more")
        return self.driver.execute_model(seqs, is_prefill)

    def sleep(self, actions: Mapping[str, str]):
        return self.driver.sleep(actions)  # the memory layer's sleep is all or nothing

    def wake(self, tags: Iterable[str] | None):
        return self.driver.wake(tags)

    def load_weights(self, named_tensors, strict: bool, reset_buffers: bool = True, staged: bool = False) -> int:
        return self.driver.load_weights(named_tensors, strict, reset_buffers, staged)

    def broken(self) -> str | None:
        return "it was closed" if self._closed else None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.driver.close()
