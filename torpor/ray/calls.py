"""A call to many replicas at once: its per-replica results, its failure naming every replica's error."""

from __future__ import annotations

import time
from collections.abc import Callable

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError


class FleetResults(list):
    """One entry per replica, in replica order; `excluded` maps the index of each replica the call did not
    reach (restarting, failed for good) to why. Its entry is None."""

    def __init__(self, values: list, excluded: dict[int, str] | None = None) -> None:
        super().__init__(values)
        self.excluded = dict(excluded or {})


class FleetError(RuntimeError):
    """A fleet call that failed on one or more replicas. `errors` maps each failed replica's index to its
    exception; `results` holds what the others answered (a FleetResults); `dead` lists replicas whose process
    died (the fleet restarts them)."""

    def __init__(self, what: str, errors: dict[int, BaseException], results: FleetResults | None = None,
                 dead: list[int] | None = None) -> None:
        self.errors, self.results, self.dead = errors, results, list(dead or [])
        parts = [f"replica {i}: {describe(e)}" for i, e in sorted(errors.items())]
        super().__init__(f"{what} failed on {len(errors)} replica(s): " + "; ".join(parts))


class FleetTimeoutError(FleetError, TimeoutError):
    """Replicas that did not answer within the call's timeout (named in `errors`, as TimeoutError)."""


class ReplicaTimeout(TimeoutError):
    """One replica that did not answer in time."""


def describe(error: BaseException) -> str:
    """An error in one line: a replica's own exception without Ray's traceback wrapping."""
    if isinstance(error, RayTaskError):
        cause = error.as_instanceof_cause()
        inner = getattr(error, "cause", None)
        if inner is not None:
            return f"{type(inner).__name__}: {inner}"
        return str(cause).strip().splitlines()[-1]
    if isinstance(error, ActorUnavailableError):
        return "the replica's actor is unreachable for now (ActorUnavailableError)"
    if isinstance(error, RayActorError):
        return f"the replica's actor died ({type(error).__name__})"
    return f"{type(error).__name__}: {error}"


def is_dead(error: BaseException) -> bool:
    """Whether `error` says the actor is gone for good (not only unreachable for now)."""
    return isinstance(error, RayActorError) and not isinstance(error, ActorUnavailableError)


def unwrap(error: BaseException) -> BaseException:
    """A replica's own exception from Ray's wrapping (RayTaskError), else the error itself."""
    if isinstance(error, RayTaskError) and getattr(error, "cause", None) is not None:
        return error.cause
    return error


Answers = tuple[dict[int, object], dict[int, BaseException], list[int]]


def gather(refs: dict[int, ray.ObjectRef], timeout_s: float, what: str,
           on_dead: Callable[[int], None] | None = None, stated_s: float | None = None) -> Answers:
    """Wait for every replica's answer within `timeout_s`. Returns (results, errors, dead): replicas that
    did not answer get a ReplicaTimeout naming them; replicas whose actor died are in `dead` (and `on_dead`
    is called for each). `stated_s`: the call's whole timeout, as the errors name it (default `timeout_s`)."""
    stated_s = timeout_s if stated_s is None else stated_s
    deadline = time.monotonic() + timeout_s
    pending = {ref: i for i, ref in refs.items()}
    results: dict[int, object] = {}
    errors: dict[int, BaseException] = {}
    dead: list[int] = []
    while pending:
        left = deadline - time.monotonic()
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, left))
        if not ready:
            for i in pending.values():
                errors[i] = ReplicaTimeout(f"no answer to {what} within {stated_s:g} s")
            break
        for ref in ready:
            i = pending.pop(ref)
            try:
                results[i] = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except RayActorError as e:
                errors[i] = e
                if is_dead(e):
                    dead.append(i)
                    if on_dead is not None:
                        on_dead(i)
            except GetTimeoutError:
                errors[i] = ReplicaTimeout(f"no answer to {what} within {stated_s:g} s")
            except Exception as e:  # the replica's own error, raised there
                errors[i] = unwrap(e)
    return results, errors, dead
