"""The Lifecycle against a small model of its states, over random operation sequences (hypothesis): every
transition either does what the model says or raises and leaves the state exactly as it was; the derived answers
(serving, may_run, may_admit, the level) always agree with the model."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from torpor.engine.lifecycle import (
    CONTEXT_LEVELS,
    DEFERRED_TAGS,
    LEVELS,
    Lifecycle,
    LifecycleError,
    tag_level,
)

TAGS = ("weights", "kv_cache", "runtime", "cuda_graph")
NAMES = frozenset(f"w{i}" for i in range(6))


@dataclasses.dataclass
class Model:
    """What the engine's state should be, written the plain way."""

    level: int | None = None
    asleep: set = dataclasses.field(default_factory=set)
    context: bool = False
    missing: set = dataclasses.field(default_factory=set)
    paused: str | None = None
    updating: str | None = None
    draining: bool = False

    @property
    def awake(self) -> bool:
        return self.level is None and not self.asleep and not self.context

    def serving(self) -> bool:
        return self.awake and not self.missing and self.updating is None and self.paused is None

    def may_run(self) -> bool:
        return self.awake and not self.missing and self.updating is None and self.paused != "all"

    def may_admit(self) -> bool:
        return self.may_run() and not self.draining and self.paused is None


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.lc = Lifecycle(TAGS, NAMES)
        self.model = Model()

    def unchanged_after(self, call) -> None:
        """A refused transition: it raises and nothing changes."""
        before = self.lc._s
        with pytest.raises((LifecycleError, ValueError)):
            call()
        assert self.lc._s == before

    @rule(level=st.sampled_from([0, 1, 2, 3, 4]))
    def sleep(self, level: int) -> None:
        m, plan = self.model, self.lc.plan_sleep(level)
        deeper_context = level in CONTEXT_LEVELS and not m.context
        if m.level is None:
            expected = {t: a for t, a in LEVELS[tag_level(level)].items() if t in TAGS} if level else {}
        elif level == 0:
            expected = None
        else:
            deeper = tag_level(level) > tag_level(m.level)
            table = LEVELS[max(tag_level(level), tag_level(m.level))]
            expected = {t: a for t, a in table.items() if t in TAGS and (t not in m.asleep or
                                                                          (deeper and t == "weights"))}
            if not expected and not deeper_context:
                expected = None
        assert (None if plan is None else dict(plan.actions)) == expected
        if plan is None:
            return
        if m.context and plan.actions:  # the engine restores the context before it sleeps more tags
            self.lc.context_restored()
            m.context, m.level = False, tag_level(m.level)
        self.lc.slept(plan)
        m.asleep |= set(plan.actions)
        if plan.actions.get("weights") == "discard":
            m.missing = set(NAMES)
        tags = max(tag_level(level), tag_level(m.level or 0))
        m.level = tags
        if plan.release_context:
            self.lc.context_checkpointed(plan)
            m.context, m.level = True, {1: 3, 2: 4}[tags]
        m.draining = False

    @rule(tags=st.sampled_from([None, ["weights"], ["kv_cache"], ["runtime"], ["weights", "kv_cache"],
                                ["scheduling"], ["bogus"]]))
    def wake(self, tags) -> None:
        if tags == ["bogus"]:
            return self.unchanged_after(lambda: self.lc.plan_wake(tags))
        m = self.model
        targets = self.lc.plan_wake(tags)
        wanted = set(TAGS) if tags is None else (set(tags) | (set(TAGS) - DEFERRED_TAGS))
        assert set(targets) == {t for t in m.asleep if t in wanted}
        if m.context:
            self.lc.context_restored()
            m.context, m.level = False, tag_level(m.level)
        self.lc.woke(targets)
        m.asleep -= set(targets)
        if not m.asleep:
            m.level = None

    @rule(tags=st.lists(st.sampled_from(TAGS), min_size=1, max_size=3, unique=True))
    def release(self, tags) -> None:
        m, plan = self.model, self.lc.plan_release(tags)
        expected = {t: LEVELS[1][t] for t in TAGS if t in tags and t not in m.asleep}
        assert (None if plan is None else dict(plan.actions)) == (expected or None)
        if plan is None:
            return
        self.lc.slept(plan)
        m.asleep |= set(plan.actions)
        if plan.actions.get("weights") == "discard":
            m.missing = set(NAMES)
        m.level = m.level if m.level not in (None, 0) else 1
        m.draining = False  # a sleep ends the drain that waited for it

    @rule(names=st.sets(st.sampled_from(sorted(NAMES))))
    def write(self, names) -> None:
        completed = self.lc.weights_written(names)
        was = bool(self.model.missing)
        self.model.missing -= names
        assert completed == (was and not self.model.missing)

    @rule()
    def reload(self) -> None:
        self.lc.weights_loaded()
        self.model.missing = set()

    @rule(written=st.sets(st.sampled_from(sorted(NAMES))))
    def failed_update(self, written) -> None:
        self.lc.weights_mixed(written)
        base = self.model.missing or set(NAMES)
        self.model.missing = (base - written) or base

    @rule(update_id=st.sampled_from(["a", "b"]))
    def begin_update(self, update_id) -> None:
        if self.model.updating not in (None, update_id):
            return self.unchanged_after(lambda: self.lc.begin_update(update_id))
        self.lc.begin_update(update_id)
        self.model.updating = update_id

    @rule(update_id=st.sampled_from(["a", "b"]))
    def end_update(self, update_id) -> None:
        self.lc.end_update(update_id)
        if self.model.updating == update_id:
            self.model.updating = None

    @rule(what=st.sampled_from(["new", "all", "later"]))
    def pause(self, what) -> None:
        if what == "later":
            return self.unchanged_after(lambda: self.lc.pause(what))
        self.lc.pause(what)
        self.model.paused = what

    @rule()
    def resume(self) -> None:
        self.lc.resume()
        self.model.paused = None

    @precondition(lambda self: self.model.level is None)
    @rule()
    def drain(self) -> None:
        self.lc.start_drain()
        self.model.draining = True

    @rule()
    def end_drain(self) -> None:
        self.lc.end_drain()
        self.model.draining = False

    @rule(level=st.sampled_from([5, -1, True, "1", 1.0]))
    def bad_level(self, level) -> None:
        self.unchanged_after(lambda: self.lc.plan_sleep(level))

    @invariant()
    def agrees(self) -> None:
        lc, m = self.lc, self.model
        assert lc.level == m.level
        assert {t for t in TAGS if lc.is_asleep(t)} == m.asleep
        assert lc.context_released == m.context
        assert set(lc.missing) == m.missing
        assert lc.serving == m.serving()
        assert lc.may_run() == m.may_run()
        assert lc.may_admit() == m.may_admit()
        state = lc.state(0, 0)
        assert state.serving == m.serving() and state.weights_valid == (not m.missing)
        assert (state.not_serving_reason() is None) == m.serving()
        assert not (m.context and not m.asleep)  # the context is released only with every tag asleep


TestLifecycle = LifecycleMachine.TestCase
TestLifecycle.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_a_failed_transition_changes_nothing():
    lc = Lifecycle(TAGS, NAMES)
    lc.begin_update("push-1")
    before = lc._s
    with pytest.raises(LifecycleError, match="'push-1' is in progress"):
        lc.begin_update("push-2")
    with pytest.raises(ValueError, match="sleep level must be one of"):
        lc.plan_sleep(7)
    with pytest.raises(ValueError, match="unknown tag"):
        lc.plan_wake(["brain"])
    assert lc._s == before and not lc.may_run()
