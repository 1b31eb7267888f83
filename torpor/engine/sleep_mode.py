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

Levels 3 and 4 are levels 1 and 2 plus the process's whole CUDA context released through the driver's
checkpoint API (`MemoryManager.checkpoint_context`): 0 MiB of device memory in the engine's process.
Level 3 = level 1's tag actions + the context; level 4 = level 2's (weights discarded) + the context. The
state is two steps, tags (level 1 or 2) and context (kept or released); a sleep while asleep goes to the
deeper of each (3 then 2 = 4, 2 then 3 = 4), sleeps the tags a selective wake left awake, and is a no-op when
it releases nothing more and deepens neither. Any wake restores the context first, then the tags.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torpor.memory import MemoryManager, Report

SLEEP_TAGS = ("weights", "kv_cache", "runtime", "workspace", "cuda_graph")
DEFERRED_TAGS = frozenset({"weights", "kv_cache"})  # wake only when named, or when all wake
CONTEXT_LEVELS = {3: 1, 4: 2}  # levels that also release the CUDA context -> the tag level they build on
SLEEP_LEVELS = (0, 1, 2, 3, 4)
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
        # Times the weights became discarded (a level-2 sleep, each; a failed update's mix, from valid weights): a
        # push counting down the tensors still missing starts over when this changed meanwhile.
        self.discards = 0
        self.context_released = False  # the CUDA context is checkpointed (level 3 or 4, until a wake)

    @property
    def tags(self) -> list[str]:
        """The engine's sleep tags that exist (no workspace / cuda_graph on CPU or without graphs)."""
        present = set(self.memory.tags())
        return [t for t in SLEEP_TAGS if t in present]

    def plan(self, level: int) -> dict[str, str] | None:
        """The memory actions of `sleep(level)` from the current state; None when it is a no-op (releases
        nothing more and deepens neither the tags nor the context). While asleep: the deeper table's actions
        on the tags still awake (a selective wake or `release_tags` leaves some), and with deeper tags the
        weights' host copy dropped. Levels 3 and 4 also release the context: see `releases_context`."""
        if type(level) is not int or level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be one of {', '.join(map(str, SLEEP_LEVELS))}, got {level!r}")
        if level == 0:
            return {} if self.level is None else None
        if self.level in (None, 0):
            return {tag: action for tag, action in LEVELS[tag_level(level)].items() if tag in self.tags}
        deeper = self._deeper_tags(level)
        table = LEVELS[max(tag_level(level), tag_level(self.level))]
        plan = {tag: action for tag, action in table.items() if tag in self.tags
                and (not self.memory.is_sleeping(tag) or (deeper and tag == "weights"))}
        return plan if plan or self._deeper_context(level) else None

    def releases_context(self, level: int) -> bool:
        """Whether the CUDA context is to be released once `sleep(level)` has slept the tags."""
        return level in CONTEXT_LEVELS or (self.context_released and self.level is not None)

    def _deeper_tags(self, level: int) -> bool:
        return tag_level(level) > tag_level(self.level or 0)

    def _deeper_context(self, level: int) -> bool:
        return level in CONTEXT_LEVELS and not self.context_released

    def joined_level(self, level: int, context: bool) -> int:
        """The level after `sleep(level)` from the current one, the context released or not."""
        tags = max(tag_level(level), tag_level(self.level or 0))
        if not context or tags == 0:
            return tags
        return {t: c for c, t in CONTEXT_LEVELS.items()}[tags]

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

    def weights_mixed(self) -> None:
        """A failed load or update left a mix of old and new weights: they count as discarded until a complete
        reload or update (an update already counting down the missing tensors goes on: what it wrote stands)."""
        if not self.weights_discarded:
            self.weights_discarded = True
            self.discards += 1

    def after_sleep(self, level: int, context_released: bool = False) -> None:
        """Record a sleep to `level` (the state afterwards: `joined_level`)."""
        self.level = self.joined_level(level, context_released)
        self.context_released = context_released
        if tag_level(self.level) == 2:
            self.weights_discarded = True
            self.discards += 1


def tag_level(level: int | None) -> int | None:
    """The tag level (0, 1 or 2) of a sleep level: 3 -> 1, 4 -> 2."""
    return CONTEXT_LEVELS.get(level, level)
