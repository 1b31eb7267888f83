"""What keeps torpor's start-up short: names exported lazily, and Python's cyclic garbage collector paused
while torpor imports its modules or builds an engine.

`import torch` leaves ~170,000 objects that the collector tracks, and its last generation is then close
to a full collection, which walks all of them: ~0.1 s at the first import of torpor's engine (measured on
CPU, half of that import's time), more with every object a start-up adds (Triton's modules on a GPU).
Nothing torpor builds at start-up is garbage that only the collector could free, so the collections are
left to after the start-up (`collector_paused`); they come as usual once it is done. (An engine dropped just
before another is built is such garbage — its model's modules and parameters reference each other — and was
freed during the new start-up only if a full collection happened to run: call `gc.collect()` in between to
give its memory to the new engine, as before.)
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import threading
from collections.abc import Iterator

from torpor.env import Env

_lock = threading.Lock()
_depth = 0  # blocks in `collector_paused`, all threads
_was_enabled = False  # the collector's state when the outermost block began


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic garbage collection inside the block (nested or concurrent blocks: until the last one
    ends); afterwards the collector is as it was before the first block (on, unless the program turned it
    off). `gc.collect()` still works inside. Also a decorator: `@collector_paused()`."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


def export(package: str, exports: dict[str, str], name: str) -> object:
    """`package.name` for a package's module `__getattr__`: imported from `exports[name]` (a module path)
    on first use, with the collector paused; AttributeError for a name the package does not export."""
    if name not in exports:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    with collector_paused():
        module = importlib.import_module(exports[name])
    return getattr(module, name)


def use_bytecode_cache(cache_dir: str | None = None, package: str = "torch") -> str | None:
    """Where Python may not write bytecode (PYTHONDONTWRITEBYTECODE, as in the H200 image this project is
    measured on) and torch's installed sources have none, every process compiles torch's 2,100 modules
    again: `import torch` took 3.9-5.0 s there instead of ~1.3 s. The `torpor` command (a process of its
    own) calls this before anything imports torch: Python then keeps the bytecode of every module it imports
    under `cache_dir/pycache` (default: torpor's cache folder, TORPOR_CACHE), not beside the sources, and the
    next start reads it. Nothing changes where bytecode may be written, where torch's is installed, or where a
    prefix is set already (PYTHONPYCACHEPREFIX) (`package`: the installed package whose bytecode decides).
    Returns the folder used, or None. Call before importing torch (torch-free; reads no engine module)."""
    import os
    import sys
    from importlib.util import cache_from_source, find_spec

    if not sys.dont_write_bytecode or sys.pycache_prefix is not None:
        return None
    spec = find_spec(package)  # finds the package without importing it
    if spec is None or spec.origin is None or os.path.exists(cache_from_source(spec.origin)):
        return None

    folder = os.path.join(cache_dir or Env.read().cache_dir, "pycache")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None  # an unwritable cache: compile as before
    sys.pycache_prefix, sys.dont_write_bytecode = folder, False
    return folder
