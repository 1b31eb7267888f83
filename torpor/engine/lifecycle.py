"""`Lifecycle`: the one owner of an engine's serving state — awake or asleep (the level, which memory tags sleep,
whether the CUDA context is released), paused, draining, whether the weights are whole (and which tensors are
missing), a weight update in progress, broken. Torch-free.

Every change is a method with a precondition; a method computes the next state whole and only then replaces
the current one, so a failed transition (it raises `LifecycleError`, or the caller's work between a plan and
its record raised) leaves the state exactly as it was. The scheduler asks it whether to step (`may_run`) and
whether to start new requests (`may_admit`); `state()` is what both front ends show.

The sleep tag table (the memory tag actions of each level):

| tag        | level 1 | level 2 |
|------------|---------|---------|
| weights    | offload | discard (then reload_weights / update_weights) |
| kv_cache   | discard | discard |
| runtime    | offload | offload |
| workspace  | discard | discard |
| cuda_graph | offload | offload |

Level 0 only pauses scheduling. Levels 3 and 4 are levels 1 and 2 plus the process's CUDA context released
(the driver's checkpoint API). A sleep while asleep goes to the deeper of each (3 then 2 = 4), sleeps the tags a
selective wake left awake, and is a no-op when it releases nothing more and deepens neither. Any wake restores
every tag but `weights` and `kv_cache`, which wake when named or when everything wakes; the context comes back
first. The engine serves once every tag is awake, the context is back and the weights are whole.

Generation may also be paused (`pause`, the engine's `pause_generation`): no new request starts ("new"), or
nothing runs ("all": running requests keep their KV). A pause is independent of sleep: a wake does not end it,
`resume` does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

SLEEP_TAGS = ("weights", "kv_cache", "runtime", "workspace", "cuda_graph")
DEFERRED_TAGS = frozenset({"weights", "kv_cache"})  # wake only when named, or when all wake
SLEEP_LEVELS = (0, 1, 2, 3, 4)
CONTEXT_LEVELS = {3: 1, 4: 2}  # levels that also release the CUDA context -> the tag level they build on
LEVELS = {
    1: {"weights": "offload", "kv_cache": "discard", "runtime": "offload", "workspace": "discard",
        "cuda_graph": "offload"},
    2: {"weights": "discard", "kv_cache": "discard", "runtime": "offload", "workspace": "discard",
        "cuda_graph": "offload"},
}
# What a sleep does with running requests: they finish first, are aborted, or are kept (level 0: frozen with their
# KV; deeper levels: back to the waiting queue, recomputed after the wake)
SLEEP_MODES = ("wait", "abort", "keep")
PAUSES = ("new", "all")  # pause_generation: no new request starts / nothing runs (running requests keep their KV)
# pause_generation's modes, vLLM's (abort, wait, keep) and SGLang's (abort, retract, in_place = keep)
PAUSE_MODES = ("abort", "wait", "keep", "retract", "in_place")


class LifecycleError(RuntimeError):
    """A transition the current state does not allow; the state is unchanged."""


def tag_level(level: int | None) -> int | None:
    """The tag level (0, 1 or 2) of a sleep level: 3 -> 1, 4 -> 2."""
    return CONTEXT_LEVELS.get(level, level)


def check_level(level: object) -> int:
    if type(level) is not int or level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be one of {', '.join(map(str, SLEEP_LEVELS))}, got {level!r}")
    return level


def check_mode(mode: object) -> str:
    if mode not in SLEEP_MODES:
        raise ValueError(f"mode must be 'wait' (running requests finish first), 'abort' or 'keep' (they continue "
                         f"after the wake), got {mode!r}")
    return mode  # type: ignore[return-value]


def check_pause_mode(mode: object) -> str:
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)} (vLLM's abort, wait, keep; SGLang's abort, "
                         f"retract, in_place), got {mode!r}")
    return mode  # type: ignore[return-value]


def check_tags(tags: object, allowed: Iterable[str] = SLEEP_TAGS) -> list[str]:
    """A list of known tag names (ValueError naming the unknown ones)."""
    if not isinstance(tags, list | tuple | set | frozenset) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"tags must be a list of tag names (e.g. ['weights']), got {tags!r}")
    allowed = list(allowed)
    unknown = sorted(set(tags) - set(allowed))
    if unknown:
        raise ValueError(f"unknown tag(s) {unknown}; the engine's tags are {allowed}")
    return list(tags)


@dataclass(frozen=True)
class SleepPlan:
    """What `sleep(level)` does from the current state: the memory actions of the tags it releases, whether it
    releases the CUDA context afterwards, and the level it leads to."""

    level: int
    actions: Mapping[str, str]
    release_context: bool
    level_after: int

    @property
    def drops_weights(self) -> bool:
        """The weights' device memory (or, already asleep, their host copy) or the CUDA context goes: no trainer's
        payload may stay opened for a copy into them."""
        return "weights" in self.actions or self.release_context


@dataclass(frozen=True)
class EngineState:
    """What the engine does now: the one state both front ends show (a snapshot)."""

    serving: bool                 # requests run: awake, every tag awake, weights whole, no update, not paused
    sleep_level: int | None       # None = awake; 0 = paused; 1, 2 = memory released; 3, 4 = and the context
    weights_valid: bool           # the weights are whole (False from a level-2 sleep or a failed update)
    tags: dict[str, str]          # memory tag -> "awake" | "asleep" (empty without sleep mode)
    num_running: int = 0          # requests in the running batch
    num_waiting: int = 0          # requests queued (new or preempted)
    paused: str | None = None     # pause_generation: "new" (no new request starts) or "all" (nothing runs)
    updating: str | None = None   # a weight update in progress (its id): nothing runs until it ends
    missing_weights: tuple[str, ...] = ()  # the tensors still to be written before the weights are whole
    broken: str | None = None     # why the engine can no longer serve (a dead tensor-parallel worker)

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level is not None

    @property
    def only_paused(self) -> bool:
        """Requests would run but for `pause_generation` (awake, weights whole, no update, not broken)."""
        return (not self.serving and self.paused is not None and self.broken is None and self.weights_valid
                and self.updating is None and self.sleep_level is None
                and all(state == "awake" for state in self.tags.values()))

    def not_serving_reason(self) -> str | None:
        """What stops requests from running and what to call about it; None while serving."""
        if self.serving:
            return None
        if self.broken is not None:
            return f"the engine cannot serve any more: {self.broken}; restart it"
        reload = "reload_weights() or a complete update_weights() (HTTP: /reload_weights)"
        missing = ""
        if not self.weights_valid and self.missing_weights:
            shown = ", ".join(self.missing_weights[:3])
            more = f" and {len(self.missing_weights) - 3} more" if len(self.missing_weights) > 3 else ""
            missing = f" ({len(self.missing_weights)} tensors not written since: {shown}{more})"
        if self.updating is not None:
            return f"a weight update ({self.updating}) is in progress: requests run once it ends"
        if self.sleep_level == 0:
            return "the engine is paused (sleep level 0): call wake_up() (HTTP: /wake_up)"
        if self.sleep_level is not None:
            asleep = [tag for tag, state in self.tags.items() if state == "asleep"]
            wake = (f"the engine sleeps (level {self.sleep_level}; asleep: {', '.join(asleep)}): call wake_up() "
                    f"(HTTP: /wake_up)")
            return wake if self.weights_valid else f"{wake}, then {reload}{missing}"
        if not self.weights_valid:
            return (f"the weights are not whole (discarded by sleep(level=2), or an update failed after writing "
                    f"part of them){missing} and every tag is awake: call {reload}")
        return (f"generation is paused ({self.paused}): call resume_generation() (HTTP: /resume, SGLang's "
                "/continue_generation)")


@dataclass(frozen=True)
class _State:
    level: int | None = None
    asleep: frozenset[str] = frozenset()
    context_released: bool = False
    missing: frozenset[str] = frozenset()  # tensors to write before the weights are whole (none: they are)
    draining: bool = False
    paused: str | None = None
    updating: str | None = None
    broken: str | None = None


class Lifecycle:
    """One engine's serving state. `tags`: the engine's sleep tags that exist (none without sleep mode);
    `weight_names`: every tensor of the checkpoint the model loads (what "whole" means)."""

    def __init__(self, tags: Iterable[str], weight_names: Iterable[str]) -> None:
        present = set(tags)
        self.tags = [t for t in SLEEP_TAGS if t in present]
        self.weight_names = frozenset(weight_names)
        self._s = _State()

    def _set(self, **changes) -> None:
        self._s = dataclasses.replace(self._s, **changes)

    # ---- queries ---------------------------------------------------------------------------------
    @property
    def level(self) -> int | None:
        return self._s.level

    @property
    def context_released(self) -> bool:
        return self._s.context_released

    @property
    def weights_whole(self) -> bool:
        return not self._s.missing

    @property
    def weights_discarded(self) -> bool:
        """Not whole and nothing of them can be trusted (a level-2 sleep or a failed update): a reload or a
        complete update makes them whole again."""
        return bool(self._s.missing)

    @property
    def missing(self) -> frozenset[str]:
        return self._s.missing

    @property
    def draining(self) -> bool:
        """A sleep waits for the running requests (none starts meanwhile)."""
        return self._s.draining

    @property
    def updating(self) -> str | None:
        return self._s.updating

    @property
    def paused(self) -> str | None:
        return self._s.paused

    @property
    def broken(self) -> str | None:
        return self._s.broken

    def is_asleep(self, tag: str) -> bool:
        return tag in self._s.asleep

    @property
    def awake(self) -> bool:
        """No sleep level, every tag awake, the context here (weights whole or not)."""
        s = self._s
        return s.level is None and not s.asleep and not s.context_released

    @property
    def serving(self) -> bool:
        s = self._s
        return self.awake and not s.missing and s.updating is None and s.broken is None and s.paused is None

    def may_run(self, ignore_pause: bool = False) -> bool:
        """Whether the scheduler may run a step (running requests go on while draining or paused for new);
        `ignore_pause`: whether it could, were generation not paused."""
        s = self._s
        return self.awake and not s.missing and s.updating is None and s.broken is None and (
            ignore_pause or s.paused != "all")

    def may_admit(self) -> bool:
        """Whether the scheduler may start new (or preempted) requests."""
        return self.may_run() and not self._s.draining and self._s.paused is None

    def state(self, num_running: int = 0, num_waiting: int = 0) -> EngineState:
        s = self._s
        return EngineState(serving=self.serving, sleep_level=s.level, weights_valid=not s.missing,
                           tags={t: "asleep" if t in s.asleep else "awake" for t in self.tags},
                           num_running=num_running, num_waiting=num_waiting, paused=s.paused,
                           updating=s.updating, missing_weights=tuple(sorted(s.missing)), broken=s.broken)

    # ---- sleep and wake --------------------------------------------------------------------------
    def plan_sleep(self, level: int) -> SleepPlan | None:
        """What `sleep(level)` does now; None when it is a no-op (releases nothing more and deepens neither the
        tags nor the context). While asleep: the deeper table's actions on the tags still awake (a selective
        wake or a release leaves some), and with deeper tags the weights' host copy dropped."""
        level, s = check_level(level), self._s
        if not self.tags:
            raise LifecycleError("sleep mode is off: build the engine with a MemoryManager (enable_sleep_mode)")
        if level == 0:
            return SleepPlan(0, {}, False, 0) if s.level is None else None
        context = level in CONTEXT_LEVELS or (s.context_released and s.level is not None)
        if s.level in (None, 0):
            actions = {t: a for t, a in LEVELS[tag_level(level)].items() if t in self.tags}
        else:
            deeper = tag_level(level) > tag_level(s.level)
            table = LEVELS[max(tag_level(level), tag_level(s.level))]
            actions = {t: a for t, a in table.items()
                       if t in self.tags and (t not in s.asleep or (deeper and t == "weights"))}
            if not actions and not (level in CONTEXT_LEVELS and not s.context_released):
                return None
        tags = max(tag_level(level), tag_level(s.level or 0))
        after = {t: c for c, t in CONTEXT_LEVELS.items()}[tags] if context else tags
        return SleepPlan(level, actions, context, after)

    def plan_release(self, tags: Iterable[str]) -> SleepPlan | None:
        """SGLang's release of named tags, each with its level-1 action; None when all of them sleep already."""
        tags = check_tags(list(tags))
        if not self.tags:
            raise LifecycleError("sleep mode is off: build the engine with a MemoryManager (enable_sleep_mode)")
        actions = {t: LEVELS[1][t] for t in self.tags if t in tags and t not in self._s.asleep}
        if not actions:
            return None
        level = self._s.level if self._s.level not in (None, 0) else 1
        return SleepPlan(1, actions, False, level)  # (the context is released only with every tag asleep)

    def slept(self, plan: SleepPlan) -> None:
        """Record a sleep that released `plan`'s tags (the context stays until `context_checkpointed`)."""
        s = self._s
        discarded = plan.actions.get("weights") == "discard"  # zero-filled: every tensor must come again
        level = tag_level(plan.level_after) if plan.release_context else plan.level_after
        self._set(level=level, asleep=s.asleep | set(plan.actions), draining=False,
                  missing=self.weight_names if discarded else s.missing)

    def context_checkpointed(self, plan: SleepPlan) -> None:
        if self._s.level is None:
            raise LifecycleError("the CUDA context is released only by a sleep")
        self._set(context_released=True, level=plan.level_after)

    def context_restored(self) -> None:
        """The context is back (the first step of any wake); the tags stay as they are."""
        s = self._s
        self._set(context_released=False, level=tag_level(s.level) if s.level is not None else None)

    def plan_wake(self, tags: Iterable[str] | None) -> list[str]:
        """The sleeping tags a `wake_up(tags)` restores (every tag but weights and kv_cache comes with any)."""
        wanted = set(SLEEP_TAGS) if tags is None else set(check_tags(tags, (*SLEEP_TAGS, "scheduling")))
        if tags is not None:
            wanted |= set(SLEEP_TAGS) - DEFERRED_TAGS
        return [t for t in self.tags if t in wanted and t in self._s.asleep]

    def woke(self, tags: Iterable[str]) -> None:
        """Record a wake of `tags`. Every tag awake and the context back: the sleep ends (level 0 too)."""
        s = self._s
        asleep = s.asleep - set(tags)
        level = None if not asleep and not s.context_released else s.level
        self._set(asleep=asleep, level=level)

    def start_drain(self) -> None:
        """A sleep waits for the running requests: no new one starts meanwhile."""
        self._set(draining=True)

    def end_drain(self) -> None:
        self._set(draining=False)

    # ---- the weights -----------------------------------------------------------------------------
    def weights_written(self, names: Iterable[str]) -> bool:
        """Tensors written by an update that completed: counted against the missing ones. Returns whether
        this made the weights whole (the caller recomputes what the checkpoint does not hold, once)."""
        if not self._s.missing:
            return False
        missing = self._s.missing - set(names)
        self._set(missing=missing)
        return not missing

    def weights_loaded(self) -> None:
        """A complete reload (or a complete update): the weights are whole."""
        self._set(missing=frozenset())

    def weights_mixed(self, written: Iterable[str] = ()) -> None:
        """An update failed after it began writing and could not put the old bytes back: a mix, never served.
        `written`: the tensors it wrote completely, each checked before it was written (the rest of a push's
        earlier requests); every other tensor is missing — the weights are whole again after a reload, a complete
        update, or an update of exactly the missing ones (the rest of the same push, resent)."""
        base = self._s.missing or self.weight_names
        self._set(missing=(base - set(written)) or base)

    def begin_update(self, update_id: str) -> None:
        """A weight update that writes in several calls (a push, the four-phase update) begins: nothing runs
        until it ends, so no step sees part of it."""
        if self._s.updating not in (None, update_id):
            raise LifecycleError(f"weight update {self._s.updating!r} is in progress; {update_id!r} must wait for "
                                 "it to end")
        self._set(updating=update_id)

    def end_update(self, update_id: str) -> None:
        """The update committed or was given up (`weights_mixed` first when it left a mix)."""
        if self._s.updating == update_id:
            self._set(updating=None)

    # ---- pause and failure -----------------------------------------------------------------------
    def pause(self, what: str) -> None:
        if what not in PAUSES:
            raise ValueError(f"pause must be one of {PAUSES}, got {what!r}")
        self._set(paused=what)

    def resume(self) -> None:
        self._set(paused=None)

    def break_(self, reason: str) -> None:
        """The engine cannot serve any more (a worker died): final."""
        if self._s.broken is None:
            self._set(broken=reason)

