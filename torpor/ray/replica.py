"""A fleet's view of one replica (its actor, state, version, load) and the health monitor that watches them all.

States: "starting" (actor being made), "serving" (routable: alive and at the fleet's weight version), "stale"
(alive, its weights behind the fleet's: it takes no requests until an update reaches it), "unresponsive"
(alive as far as Ray knows, but its liveness probe has not answered within the hang timeout: no new requests;
it is "serving" again once it answers), "restarting", "failed" (restarts used up, or it could not start), and
"stopped" (after shutdown).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from torpor.ray.calls import is_dead
from torpor.ray.placement import Slot

LIVE = ("serving", "stale", "unresponsive")  # states whose actor runs: control calls go to them


@dataclass
class Replica:
    index: int
    slot: Slot
    handle: ActorHandle | None = None
    state: str = "starting"
    incarnation: str | None = None
    weight_version: int | str = 0
    restarts: int = 0
    outstanding: int = 0          # sequences routed to it and not answered
    last_error: str | None = None
    groups: set[str] = field(default_factory=set)  # weights update groups it joined (this incarnation)
    ready: threading.Event = field(default_factory=threading.Event)  # set when not starting/restarting

    @property
    def routable(self) -> bool:
        return self.state == "serving"

    def describe(self) -> str:
        extra = f", last error: {self.last_error}" if self.last_error and self.state != "serving" else ""
        return f"replica {self.index} ({self.state}, restarts {self.restarts}{extra})"


class HealthMonitor:
    """Pings every live replica every `interval_s` (the actor's "health" threads answer while it generates or
    receives weights). A ping that fails because the actor died calls `on_dead(replica)` within about a second
    of the death; one unanswered for `hang_timeout_s` marks the replica unresponsive (no new requests) until it
    answers again."""

    def __init__(self, replicas: list[Replica], lock: threading.RLock, on_dead: Callable[[Replica], None],
                 on_state: Callable[[], None], interval_s: float, hang_timeout_s: float) -> None:
        self.replicas, self.lock, self.on_dead, self.on_state = replicas, lock, on_dead, on_state
        self.interval_s, self.hang_timeout_s = interval_s, hang_timeout_s
        self._pings: dict[int, tuple[ray.ObjectRef, float, ActorHandle]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torpor-fleet-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._check()
            except Exception:  # never let the monitor die: the next round tries again
                continue

    def _check(self) -> None:
        with self.lock:
            live = [r for r in self.replicas if r.state in LIVE and r.handle is not None]
        for replica in live:
            sent = self._pings.get(replica.index)
            if sent is not None and sent[2] is not replica.handle:  # a ping of an earlier incarnation
                sent = self._pings.pop(replica.index)
                sent = None
            if sent is None:
                self._pings[replica.index] = (replica.handle.ping.remote(), time.monotonic(), replica.handle)
                continue
            ref, since, handle = sent
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                del self._pings[replica.index]
                try:
                    ray.get(ref)
                except RayActorError as e:
                    if is_dead(e):
                        self.on_dead(replica)
                    continue
                except Exception:
                    continue
                with self.lock:
                    if replica.state == "unresponsive" and replica.handle is handle:
                        replica.state = "serving"  # answers again (its weight version is checked on routing)
                        self.on_state()
            elif time.monotonic() - since > self.hang_timeout_s:
                with self.lock:
                    if replica.state == "serving" and replica.handle is handle:
                        replica.state = "unresponsive"
                        replica.last_error = f"its liveness probe did not answer within {self.hang_timeout_s:g} s"
                        self.on_state()
