"""Triton kernels written as plain functions of a module and jitted on first use, so that importing the module
never imports triton: CPU engines never need it, and Triton's interpreter tests must set TRITON_INTERPRET before
its first import. Used by models/layers/fused.py and sampler_kernels.py."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable


class LazyJit:
    """`@kernels.jit` marks a function of the module whose globals are `namespace`; `kernels.load()` imports
    triton, binds `triton` and `tl` in that namespace (the kernels look them up there when they are compiled)
    and replaces each marked function by its `triton.jit`, once. False where triton cannot be imported."""

    def __init__(self, namespace: dict) -> None:
        self._namespace = namespace
        self._names: list[str] = []
        self._lock = threading.Lock()
        self._loaded: bool | None = None

    def jit(self, fn: Callable) -> Callable:
        self._names.append(fn.__name__)
        return fn

    def load(self) -> bool:
        if self._loaded is None:  # every launch asks: no lock once it is known
            with self._lock:
                if self._loaded is None:
                    self._loaded = self._import()
        return self._loaded

    def _import(self) -> bool:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            return False
        self._namespace.update(triton=triton, tl=tl)
        for name in self._names:
            self._namespace[name] = triton.jit(self._namespace[name])
        return True


def warm_triton_cache_key() -> threading.Thread:
    """Start a thread computing Triton's cache key of its own installation and return it (join it before the first
    launch). Triton hashes its compiler — its sources and its ~0.5 GB libtriton — once per process, on the first
    launch of any kernel, even one it finds compiled in its disk cache: ~0.4 s of hashing and reading inside a
    start-up's first graph warm-up on an H200 (docs/weights.md). Both release the GIL, so the
    thread does them beside the model build and the weight load. A Triton without the function (the key moved
    between versions) makes the thread a no-op."""

    def compute() -> None:
        import importlib

        for module in ("triton.runtime.cache", "triton.compiler.compiler"):
            try:
                triton_key = getattr(importlib.import_module(module), "triton_key", None)
                if triton_key is not None:
                    triton_key()  # functools.lru_cache: the first launch finds it computed
                    return
            except Exception as e:  # the first launch computes it itself (and raises what it raises)
                logging.getLogger("torpor.engine").debug("Triton's cache key not computed ahead: %s", e)
                return

    thread = threading.Thread(target=compute, name="torpor-triton-key", daemon=True)
    thread.start()
    return thread
