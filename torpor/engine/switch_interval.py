"""Python's thread switch interval while several of torpor's threads share the GIL.

A thread that released the GIL (every PyTorch op does, every driver call) and wants it back waits until the
holder lets it go; a holder running pure Python keeps it up to `sys.getswitchinterval()` (5 ms by default)
before it is asked to. Where torpor runs Python on several threads at once — the weight load beside the
start-up's graph capture, a server's engine thread beside its event loop and its weight-staging thread — each
such wait stalls the thread on the critical path. `TORPOR_SWITCH_INTERVAL_US` (default 200 µs; 0 keeps
Python's) bounds it; the figures that chose it are in docs/weights.md and docs/rl.md.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from torpor.env import Env


def wanted_interval() -> float | None:
    """The interval torpor asks for, in seconds; None where it would not shorten the current one."""
    micros = Env.read().switch_interval_us
    if micros <= 0 or micros / 1e6 >= sys.getswitchinterval():
        return None
    return micros / 1e6


@contextlib.contextmanager
def short_switch_interval() -> Iterator[None]:
    """Within: the shorter interval (process-wide, restored afterwards)."""
    interval = wanted_interval()
    if interval is None:
        yield
        return
    previous = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def shorten_switch_interval() -> float:
    """For a process whose threads always share the GIL (`torpor serve`): the shorter interval from now on.
    Returns the interval in force."""
    interval = wanted_interval()
    if interval is not None:
        sys.setswitchinterval(interval)
    return sys.getswitchinterval()
