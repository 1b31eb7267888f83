"""`Executor`: how an engine reaches its ranks. One `Worker` per rank; rank 0's (the driver) lives in the engine's
process. `collective_rpc` calls a Worker method by name (or a function taking the Worker) on every rank and returns
one result per rank; the other operations are the ones with a policy of their own across ranks (a step, an
all-or-nothing sleep, a stream of weights). No code outside the executors depends on the number of ranks.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torpor.engine.sampler import SamplerOutput
from torpor.engine.sequence import Sequence
from torpor.engine.worker import Worker


class RankError(RuntimeError):
    """A call failed on one rank; `cause` is that rank's exception (type kept when it pickles)."""

    def __init__(self, rank: int, cause: BaseException, detail: str = "") -> None:
        super().__init__(f"tensor-parallel rank {rank}: {type(cause).__name__}: {cause}{detail}")
        self.rank, self.cause = rank, cause


class WorkerDiedError(RuntimeError):
    """A worker process exited, or did not answer in time; the engine cannot run any more."""


Method = str | Callable[..., Any]


@functools.cache
def with_extension(worker_cls: type[Worker], extension: str | None) -> type[Worker]:
    """vLLM's worker extension: the class at the dotted path `extension` ("pkg.module.Class") mixed into
    `worker_cls` as `type("Worker", (worker_cls, ext), {})`, so its methods run on every rank with the Worker's
    state (`self.rank`, `self.device`, `self.runner`, ...) and `collective_rpc` reaches them by name. Built in every
    rank's process from the same path (the engine's config), once per process. As vLLM does, an extension may not
    define a name the Worker has (it would replace the engine's own method). `extension_methods` on the class: the
    extension's public methods, the ones `collective_rpc` offers from outside."""
    if extension is None:
        return worker_cls
    module_name, _, class_name = extension.rpartition(".")
    try:
        ext = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"worker_extension_cls {extension!r} cannot be imported: {type(exc).__name__}: {exc}") \
            from None
    if not inspect.isclass(ext):
        raise ValueError(f"worker_extension_cls {extension!r} is not a class")
    clashes = sorted(name for name in vars(ext) if not name.startswith("__") and hasattr(worker_cls, name))
    if clashes:
        raise ValueError(f"worker_extension_cls {extension!r} defines {clashes}, which the Worker has already; "
                         "rename them (an extension adds methods, it never replaces the engine's)")
    methods = frozenset(name for name, value in inspect.getmembers(ext, callable) if not name.startswith("_"))
    return type("Worker", (worker_cls, ext), {"extension_methods": methods, "__module__": worker_cls.__module__})


def bound(worker: Worker, method: Method) -> Callable[..., Any]:
    """`worker.method`, or a function called with the worker first (vLLM's collective_rpc)."""
    if callable(method):
        return lambda *args, **kwargs: method(worker, *args, **kwargs)
    if not isinstance(method, str) or method.startswith("_"):
        raise ValueError(f"collective_rpc: method must be a public Worker method name or a callable, got {method!r}")
    function = getattr(worker, method, None)
    if not callable(function):
        raise ValueError(f"collective_rpc: the Worker has no method {method!r} (a worker extension adds methods: "
                         "worker_extension_cls)")
    return function


class Executor(ABC):
    """`driver`: rank 0's Worker (in this process); `world_size`: the ranks."""

    driver: Worker
    world_size: int

    @property
    def config(self):
        """The driver's configuration (with the profiled number of KV blocks)."""
        return self.driver.config

    @abstractmethod
    def collective_rpc(self, method: Method, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list:
        """`method(*args, **kwargs)` on every rank; the results in rank order. A failure on any rank raises (that
        rank's error; a worker's as a RankError)."""

    @abstractmethod
    def execute_model(self, seqs: list[Sequence], is_prefill: bool) -> SamplerOutput:
        """One step on every rank; rank 0 samples."""

    @abstractmethod
    def sleep(self, actions: Mapping[str, str]):
        """Sleep `actions` on every rank, all or nothing: a failure on any rank leaves every rank awake."""

    @abstractmethod
    def wake(self, tags: Iterable[str] | None):
        """Wake `tags` on every rank (a failure raises; tags already awake are skipped on retry)."""

    @abstractmethod
    def load_weights(self, named_tensors, strict: bool, reset_buffers: bool = True, staged: bool = False) -> int:
        """Hugging Face-named tensors into every rank's weights (each keeps its shard); the count."""

    def broken(self) -> str | None:
        """Why the engine cannot run any more (a dead or hung worker), or None: final."""
        return None

    def health(self) -> str | None:
        """Why the engine cannot run now (broken, or a worker stopped), or None."""
        return self.broken()

    @abstractmethod
    def close(self) -> None:
        """Stop every rank; the engine cannot run afterwards."""
