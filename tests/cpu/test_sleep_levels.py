"""Sleep levels 3 and 4 without a GPU (the level table, the preconditions and their errors), re-sleep without
copying the weights, and the host copies reserved at start-up, on the CPU engine."""

from __future__ import annotations

import pytest
import torch

from torpor.engine import LLM, SamplingParams
from torpor.engine.lifecycle import Lifecycle
from torpor.engine.weights.loader import iter_checkpoint
from torpor.memory import CheckpointError, CheckpointUnsupportedError
from torpor.testing.harness import differences, fixed_requests, run_round


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(tiny_model_path, device="cpu", max_num_seqs=8, max_model_len=128)


@pytest.fixture(autouse=True)
def awake(llm):
    yield
    if llm.is_sleeping():
        llm.wake_up()
    if llm.engine.lifecycle.weights_discarded:
        llm.reload_weights()


@pytest.fixture(scope="module")
def requests(llm):
    return fixed_requests(6, llm.engine.vocab_size, max_prompt=20, max_tokens=6)


# ---- the level table -------------------------------------------------------------------------
@pytest.fixture
def lifecycle():
    return Lifecycle(("weights", "kv_cache", "runtime"), ("w",))


def _after(lc: Lifecycle, *levels: int) -> Lifecycle:
    """Each sleep as the engine does it: the plan first; the context restored when tags must sleep while it is
    released; the tags; then the context when the plan releases it."""
    for level in levels:
        plan = lc.plan_sleep(level)
        if plan is not None:
            if lc.context_released and plan.actions:
                lc.context_restored()
            lc.slept(plan)
            if plan.release_context:
                lc.context_checkpointed(plan)
    return lc


def test_levels_three_and_four_are_one_and_two_plus_the_context(lifecycle):
    one, two = lifecycle.plan_sleep(1), lifecycle.plan_sleep(2)
    three, four = lifecycle.plan_sleep(3), lifecycle.plan_sleep(4)
    assert three.actions == one.actions == {"weights": "offload", "kv_cache": "discard", "runtime": "offload"}
    assert four.actions == two.actions
    assert three.release_context and four.release_context
    assert not one.release_context and not two.release_context


@pytest.mark.parametrize(("first", "then", "plan", "level"), [
    (1, 3, {}, 3),                           # the context only
    (3, 4, {"weights": "discard"}, 4),       # drop the weights' copy, context stays released
    (3, 2, {"weights": "discard"}, 4),       # the deeper of each: tags 2, context released
    (2, 3, {}, 4),
    (1, 4, {"weights": "discard"}, 4),
    (3, 1, None, 3),                         # deepens nothing: no-op
    (4, 3, None, 4),
    (4, 2, None, 4),
    (0, 3, {"weights": "offload", "kv_cache": "discard", "runtime": "offload"}, 3),
])
def test_sleeping_deeper_goes_to_the_deeper_of_tags_and_context(lifecycle, first, then, plan, level):
    _after(lifecycle, first)
    found = lifecycle.plan_sleep(then)
    assert (None if found is None else dict(found.actions)) == plan
    if plan is not None:
        _after(lifecycle, then)
    assert lifecycle.level == level
    assert lifecycle.context_released == (level in (3, 4))
    assert lifecycle.weights_discarded == (level in (2, 4))


def test_bad_levels(lifecycle):
    for bad in (5, -1, True, "3", 2.0):
        with pytest.raises(ValueError, match="sleep level must be one of 0, 1, 2, 3, 4"):
            lifecycle.plan_sleep(bad)


# ---- level 3 on the CPU engine: a clear error, nothing touched -------------------------------
@pytest.mark.parametrize("level", [3, 4])
def test_level_three_on_cpu_is_refused_before_anything_is_touched(llm, requests, level):
    reference = run_round(llm, requests)
    usage = llm.memory_usage()
    with pytest.raises(CheckpointUnsupportedError, match=f"sleep level {level} releases the CUDA context; this "
                                                         "engine runs on cpu"):
        llm.sleep(level)
    assert not llm.is_sleeping() and llm.memory_usage()["tags"] == usage["tags"]
    assert not llm.engine.lifecycle.context_released
    assert not differences(reference, run_round(llm, requests))


def test_level_three_while_asleep_on_cpu_keeps_the_level(llm):
    llm.sleep(1)
    with pytest.raises(CheckpointUnsupportedError):
        llm.sleep(3)
    assert llm.memory_usage()["level"] == 1
    llm.wake_up()


def test_a_failed_context_release_leaves_the_engine_as_before(llm, requests, monkeypatch):
    """The failure path after the tags slept: skip the precondition so the CPU manager's real refusal comes
    from checkpoint_context itself, as a driver failure would."""
    reference = run_round(llm, requests)
    monkeypatch.setattr(type(llm.engine), "_check_context_release", lambda self, level: None)
    with pytest.raises(CheckpointError, match="the engine is awake and serving as before"):
        llm.sleep(3)
    assert not llm.is_sleeping() and not llm.engine.lifecycle.context_released
    assert not differences(reference, run_round(llm, requests))
    with pytest.raises(CheckpointError, match=r"stays asleep at level 2 \(weights discarded"):
        llm.sleep(4)  # the weights are gone already: a level-2 sleep is what is left
    assert llm.memory_usage()["level"] == 2 and llm.engine.lifecycle.weights_discarded
    llm.wake_up()
    llm.reload_weights()
    assert not differences(reference, run_round(llm, requests))


# ---- re-sleep without copying -----------------------------------------------------------------
def _weights_copied(report) -> int:
    return next(t.bytes_copied for t in report.tags if t.tag == "weights")


def test_resleep_keeps_the_weights_copy_until_they_are_written(llm, requests, monkeypatch):
    monkeypatch.setenv("TORPOR_VERIFY_CLEAN_COPIES", "1")  # any undeclared write to the weights raises
    reference = run_round(llm, requests)
    llm.sleep(1)
    llm.wake_up()
    run_round(llm, requests)  # serving does not write the weights
    again = llm.sleep(1)
    assert _weights_copied(again) == 0 and again.bytes_released > 0
    llm.wake_up(["weights"])  # the RL order: weights first
    llm.update_weights(iter_checkpoint(llm.config.model))  # a push writes them: copied again next time
    llm.wake_up(["kv_cache"])
    assert _weights_copied(llm.sleep(1)) > 0
    llm.wake_up()
    llm.reload_weights()
    assert _weights_copied(llm.sleep(1)) > 0
    llm.wake_up()
    assert not differences(reference, run_round(llm, requests))


def test_an_undeclared_weight_write_is_caught(llm, requests, monkeypatch):
    reference = run_round(llm, requests)
    llm.sleep(1)
    llm.wake_up()
    weight = next(llm.engine.executor.driver.runner.model.parameters())
    with torch.no_grad():
        weight.view(-1)[0] += 1.0  # behind the engine's back
    monkeypatch.setenv("TORPOR_VERIFY_CLEAN_COPIES", "1")
    with pytest.raises(Exception, match="mark_dirty"):
        llm.sleep(1)
    assert not llm.is_sleeping()  # a failed sleep leaves the engine awake
    with torch.no_grad():
        weight.view(-1)[0] -= 1.0
    llm.engine.collective_rpc("mark_weights_dirty")
    assert not differences(reference, run_round(llm, requests))


# ---- host copies reserved at start-up ---------------------------------------------------------
def test_host_copies_are_reserved_in_the_background(tiny_model_path):
    llm = LLM(tiny_model_path, device="cpu", max_num_seqs=2, max_model_len=64)
    reservation = llm.engine.host_reservation
    assert reservation is not None and reservation.wait(60) and reservation.error is None
    usage = llm.memory_usage()
    assert usage["host_reservation"]["done"] and usage["host_reservation"]["reserved_bytes"] > 0
    assert usage["host_backup_bytes"] == reservation.reserved_bytes
    assert usage["tags"]["weights"]["host_backup_bytes"] > 0  # before any sleep
    first = [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))]
    llm.sleep(1)
    llm.wake_up()
    again = [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))]
    assert first == again


def test_reserving_host_copies_can_be_turned_off(tiny_model_path):
    llm = LLM(tiny_model_path, device="cpu", max_num_seqs=2, max_model_len=64, reserve_host_copies=False)
    assert llm.engine.host_reservation is None
    usage = llm.memory_usage()
    assert usage["host_backup_bytes"] == 0 and usage["host_reservation"] is None
    with pytest.raises(ValueError, match="reserve_host_copies must be True or False"):
        LLM(tiny_model_path, device="cpu", max_num_seqs=2, max_model_len=64, reserve_host_copies="no")
