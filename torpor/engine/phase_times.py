"""Where the time of one engine operation goes, phase by phase (a weight push's decode, check, copy, ...; an
engine's start-up: `LLM.startup_phases`).

`collect()` opens a record for the current thread of control; code deeper down marks its phases with
`phase(name)` without being handed the record (a no-op when nobody collects: a `perf_counter` pair and a
context-variable read, ~1 µs). `torpor bench weights` prints the record of every push request so a GPU run
shows which fixed costs a bucket pays.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator

_current: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("torpor_phase_times", default=None)


@contextlib.contextmanager
def collect() -> Iterator[dict[str, float]]:
    """A fresh record (phase name -> seconds, summed over repeats) for the phases run inside the block; the
    block also gets "total". Nested collects each get their own record."""
    record: dict[str, float] = {}
    token = _current.set(record)
    start = time.perf_counter()
    try:
        yield record
    finally:
        record["total"] = time.perf_counter() - start
        _current.reset(token)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the block's seconds to `name` in the record being collected, if any."""
    record = _current.get()
    if record is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        record[name] = record.get(name, 0.0) + time.perf_counter() - start


def add(name: str, seconds: float) -> None:
    """Add `seconds` measured elsewhere (another thread's work) to `name` in the record being collected, if any."""
    record = _current.get()
    if record is not None:
        record[name] = record.get(name, 0.0) + seconds
