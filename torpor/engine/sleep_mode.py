"""Sleep levels and selective wake of one engine, over its `MemoryManager`; the tag table:

| tag        | level 1 | level 2 |
|------------|---------|---------|
| weights    | offload | discard (then reload_weights / update_weights) |
| kv_cache   | discard | discard |
| runtime    | offload | offload |
| workspace  | discard | discard |
| cuda_graph | offload | offload |

Level 0 only pauses scheduling. Any wake restores every tag except `weights` and `kv_cache`, which
wake when named or when everything wakes. Runtime state is offloaded at every level and comes back
at the same addresses, so captured CUDA graphs stay valid.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torpor.memory import MemoryManager, Report

SLEEP_TAGS = ("weights", "kv_cache", "runtime", "workspace", "cuda_graph")
DEFERRED_TAGS = frozenset({"weights", "kv_cache"})  # wake only when named, or when all wake
LEVELS = {
    1: {"weights": "offload", "kv_cache": "discard", "runtime": "offload", "workspace": "discard",
        "cuda_graph": "offload"},
    2: {"weights": "discard", "kv_cache": "discard", "runtime": "offload", "workspace": "discard",
        "cuda_graph": "offload"},
}


@dataclass(frozen=True)
class WakeResult:
    """What a `wake_up` did: the memory report, which tags woke, and whether the engine serves."""

    report: Report
    woken: tuple[str, ...]
    serving: bool


class SleepMode:
    """The sleep state of one engine: its level (None = awake), its weights' validity."""

    def __init__(self, memory: MemoryManager) -> None:
        self.memory = memory
        self.level: int | None = None
        self.weights_discarded = False  # zero-filled by a level-2 sleep until reloaded or updated

    @property
    def tags(self) -> list[str]:
        """The engine's sleep tags that exist (no workspace / cuda_graph on CPU or without graphs)."""
        present = set(self.memory.tags())
        return [t for t in SLEEP_TAGS if t in present]

    def plan(self, level: int) -> dict[str, str] | None:
        """The memory actions of `sleep(level)` from the current state; None when it is a no-op
        (same or shallower level). Level 1 -> 2 only drops the weights' host copy."""
        if isinstance(level, bool) or level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}")
        if self.level is not None and level <= self.level:
            return None
        if level == 0:
            return {}
        if self.level in (1, 2):  # deeper while asleep
            return {"weights": "discard"}
        return {tag: action for tag, action in LEVELS[level].items() if tag in self.tags}

    def wake_targets(self, tags: Iterable[str] | None) -> list[str]:
        """The sleeping tags a `wake_up(tags)` restores."""
        if tags is None:
            wanted = set(SLEEP_TAGS)
        elif not isinstance(tags, list | tuple | set | frozenset) or not all(isinstance(t, str) for t in tags):
            raise ValueError(f"tags must be a list of tag names (e.g. ['weights']), got {tags!r}")
        else:
            wanted = set(tags)
            unknown = sorted(wanted - set(SLEEP_TAGS))
            if unknown:
                raise ValueError(f"unknown tag(s) {unknown}; the engine's tags are {list(SLEEP_TAGS)}")
            wanted |= set(SLEEP_TAGS) - DEFERRED_TAGS
        return [t for t in self.tags if t in wanted and self.memory.is_sleeping(t)]

    def after_sleep(self, level: int) -> None:
        self.level = level
        if level == 2:
            self.weights_discarded = True
