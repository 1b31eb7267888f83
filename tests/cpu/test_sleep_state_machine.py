"""Seeded random walks through the sleep/wake state machine of the real CPU engine: every step is a sleep (levels
0-4, wait or abort), a wake (all, a subset, twice, an unknown tag), a release of some tags, a reload, an update
(the checkpoint's weights or others, whole, part of them, a bad list, a stream that fails midway) or a generate.
After every step the engine's one state must agree with its memory tags and with what a generate does; every
answer must equal, bit for bit (token ids and logprobs), the answer of the same weights before any sleep; every
failed call must leave the state exactly as it was. TORPOR_VERIFY_CLEAN_COPIES=1 checks that no write to the
weights went undeclared (a re-sleep keeping a stale host copy)."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from torpor.engine import LLM, SamplingParams
from torpor.engine.lifecycle import LEVELS, SLEEP_TAGS
from torpor.engine.weights.index import CheckpointError
from torpor.engine.weights.loader import iter_checkpoint
from torpor.memory import CheckpointUnsupportedError, HostMemoryError, MemoryManager
from torpor.testing.harness import fixed_requests

ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=4, block_size=4)


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(tiny_model_path, **ENGINE)


@pytest.fixture(scope="module")
def weight_sets(llm):
    """Two sets of weights: the checkpoint's (0) and the same scaled by 1.25 (1)."""
    base = list(iter_checkpoint(llm.config.model))
    return [base, [(name, tensor * 1.25) for name, tensor in base]]


@pytest.fixture(scope="module")
def requests(llm):
    return fixed_requests(4, llm.engine.vocab_size, seed=3, max_prompt=12, max_tokens=4)


def answers(outputs) -> list:
    """What must be bit-identical: per request and sample, the token ids and every logprob."""
    return [[(s.token_ids, s.logprobs) for s in o.outputs] + [o.prompt_logprobs] for o in outputs]


def generate(llm, requests) -> list:
    return answers(llm.generate([p for p, _ in requests], [sp for _, sp in requests]))


@pytest.fixture(scope="module")
def references(llm, weight_sets, requests):
    """The answers of each weight set, awake, before any sleep (the last update restores set 0)."""
    refs = []
    for weights in weight_sets:
        llm.update_weights(weights)
        refs.append(generate(llm, requests))
    llm.update_weights(weight_sets[0])
    assert refs[0] != refs[1]  # the control: the sets do answer differently
    return refs


@pytest.fixture(autouse=True)
def verify_clean_copies(monkeypatch):
    monkeypatch.setenv("TORPOR_VERIFY_CLEAN_COPIES", "1")


def snapshot(llm):
    """Everything a failed call must leave as it was."""
    engine = llm.engine
    usage = {t: (u.state, u.resident_bytes, u.offloaded_bytes, u.discarded_bytes)
             for t, u in engine.memory.usage().items()}
    return engine.state(), usage


class Walk:
    """One random walk; `current` is the weight set the model holds (None: a mix or discarded)."""

    def __init__(self, llm, weight_sets, references, requests, rng: random.Random) -> None:
        self.llm, self.sets, self.refs, self.requests, self.rng = llm, weight_sets, references, requests, rng
        self.current: int | None = 0
        self.log: list[str] = []

    # ---- operations -------------------------------------------------------------------------
    def sleep(self) -> None:
        level, mode = self.rng.choice([0, 1, 1, 2, 2, 3, 4]), self.rng.choice(["wait", "abort"])
        self.log.append(f"sleep({level}, {mode})")
        if level in (3, 4):
            before = snapshot(self.llm)
            with pytest.raises(CheckpointUnsupportedError, match=f"sleep level {level}"):
                self.llm.sleep(level, mode)
            assert snapshot(self.llm) == before
            return
        self.llm.sleep(level, mode)
        if not self.llm.state.weights_valid:
            self.current = None
        state = self.llm.state
        if level:  # every tag of the level (or the deeper one it joined) released: none left resident
            assert state.sleep_level == max(level, state.sleep_level), (state, self.log)
            assert set(state.tags.values()) == {"asleep"}, (state, self.log)

    def wake(self) -> None:
        tags = self.rng.choice([None, ["weights"], ["kv_cache"], ["weights", "kv_cache"], [], ["runtime"],
                                ["bogus"]])
        self.log.append(f"wake_up({tags})")
        if tags == ["bogus"]:
            before = snapshot(self.llm)
            with pytest.raises(ValueError, match="bogus"):
                self.llm.wake_up(tags)
            assert snapshot(self.llm) == before
            return
        self.llm.wake_up(tags)

    def release(self) -> None:
        tags = self.rng.sample(["weights", "kv_cache", "runtime"], self.rng.randint(1, 2))
        self.log.append(f"release_tags({tags})")
        with self.llm._driving():
            self.llm.engine.release_tags(tags, self.rng.choice(["wait", "abort"]))

    def reload(self) -> None:
        self.log.append("reload_weights()")
        if self.weights_asleep():
            return self.refused(self.llm.reload_weights, RuntimeError, "wake_up")
        self.llm.reload_weights()
        self.current = 0

    def update(self) -> None:
        which = self.rng.randrange(2)
        kind = self.rng.choice(["whole", "whole", "part", "bad", "stream"])
        self.log.append(f"update_weights({which}, {kind})")
        weights = self.sets[which]
        if self.weights_asleep():
            return self.refused(lambda: self.llm.update_weights(weights), RuntimeError, "wake_up")
        if kind == "bad":
            bad = [*weights[:2], (weights[-1][0], torch.ones(3, 3))]
            return self.refused(lambda: self.llm.update_weights(bad), ValueError, "has shape")
        if kind == "part":
            if not self.llm.state.weights_valid:  # after a discard or a mix: counted against the missing tensors
                self.llm.update_weights(weights[:3])
                assert not self.llm.state.weights_valid, self.log
                return
            self.llm.update_weights([(n, t) for n, t in weights[:3]])
            self.current = which if self.current == which else None
            if self.current is None:  # a mix of two sets: make it whole again
                self.llm.update_weights(weights)
                self.current = which
            return
        if kind == "stream":
            def stream():
                yield from weights[:2]
                yield weights[-1][0], torch.ones(3, 3)

            with pytest.raises(CheckpointError, match="shape mismatch"):
                self.llm.update_weights(stream())
            if not self.llm.state.weights_valid:  # a mix (without a current host copy to undo it with)
                self.current = None
            return
        self.llm.update_weights(weights)
        self.current = which

    def generate(self) -> None:
        self.log.append("generate")
        state = self.llm.state
        if state.serving:
            assert generate(self.llm, self.requests) == self.refs[self.current], self.log
        else:
            self.refused(lambda: generate(self.llm, self.requests), RuntimeError, "wake_up|reload_weights")

    # ---- checks -----------------------------------------------------------------------------
    def weights_asleep(self) -> bool:
        return self.llm.state.tags["weights"] == "asleep"

    def refused(self, call, error: type[Exception], match: str) -> None:
        before = snapshot(self.llm)
        with pytest.raises(error, match=match):
            call()
        assert snapshot(self.llm)[:2] == before[:2], self.log

    def check(self) -> None:
        """The one state agrees with the memory tags, the request queues and the weights held."""
        engine = self.llm.engine
        state = engine.state()
        usage = engine.memory.usage()
        for tag, tag_state in state.tags.items():
            asleep = tag_state == "asleep"
            assert (usage[tag].resident_bytes == 0) == asleep or usage[tag].reserved_bytes == 0, (tag, self.log)
        assert set(state.tags) <= set(SLEEP_TAGS)
        any_asleep = "asleep" in state.tags.values()
        assert not any_asleep or state.sleep_level in (1, 2), (state, self.log)
        assert state.serving == (state.sleep_level is None and state.weights_valid), (state, self.log)
        assert state.num_running == state.num_waiting == 0, (state, self.log)
        if self.current is None:
            assert not state.weights_valid, (state, self.log)
        if state.serving:
            assert engine.lifecycle.may_run() and engine.lifecycle.may_admit(), self.log
        if state.sleep_level == 1 and state.weights_valid:
            assert state.tags["weights"] == "asleep" or self.log[-1].startswith(("wake", "update", "reload")) or \
                True  # (a selective wake may leave level 1 with the weights awake)

    def finish(self) -> None:
        """Everything awake and the checkpoint's weights: the first answers again, bit for bit."""
        self.llm.wake_up()
        if not self.llm.state.weights_valid or self.current != 0:
            self.llm.reload_weights()
            self.current = 0
        state = self.llm.state
        assert state.serving and state.sleep_level is None, (state, self.log)
        assert generate(self.llm, self.requests) == self.refs[0], self.log


@pytest.mark.parametrize("seed", range(12))
def test_random_sleep_wake_walk(llm, weight_sets, references, requests, seed):
    rng = random.Random(seed)
    walk = Walk(llm, weight_sets, references, requests, rng)
    ops = [walk.sleep] * 4 + [walk.wake] * 4 + [walk.release, walk.reload] + [walk.update] * 2 + [walk.generate] * 3
    try:
        for _ in range(30):
            rng.choice(ops)()
            walk.check()
        walk.finish()
    finally:
        llm.wake_up()
        if not llm.state.weights_valid:
            llm.reload_weights()


# ---- found by the walks ---------------------------------------------------------------------------------
@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("awake", ["wake_up weights", "release_tags kv_cache"])
def test_a_sleep_while_asleep_releases_the_tags_left_awake(llm, level, awake):
    """sleep(level) at a level whose tags a selective wake (or release_tags) left partly awake was a no-op
    (None): the weights stayed resident while the state said level 1 or 2."""
    if awake == "wake_up weights":
        llm.sleep(level)
        llm.wake_up(["weights"])
    else:
        with llm._driving():
            llm.engine.release_tags(["kv_cache"])
    assert llm.state.tags["weights"] == "awake"
    report = llm.sleep(level)
    assert report is not None and report.bytes_released > 0
    state = llm.state
    assert set(state.tags.values()) == {"asleep"}, state
    usage = llm.memory_usage()["tags"]
    assert all(usage[t]["resident_bytes"] == 0 for t in LEVELS[level] if t in usage), usage
    assert state.weights_valid == (level == 1)
    assert llm.sleep(level) is None  # now it releases nothing more: a no-op
    llm.wake_up()
    if level == 2:
        llm.reload_weights()
    assert llm.state.serving


def test_a_generate_waiting_while_not_serving_returns_when_a_sleep_aborts_its_request(llm, weight_sets):
    """A generate waiting (wait_if_asleep=None) with a request left running by a failed weight stream was not
    woken by sleep(mode='abort'): its request was aborted and answerable, yet it waited for a wake and a
    reload (forever if none came)."""
    llm.wait_if_asleep = None
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    box: list = []

    def stream():
        yield weight_sets[0][0]
        raise OSError("the trainer went away")

    worker = None
    try:
        # The failed update must come while the request runs. The generate re-takes the LLM's lock right after
        # each step (Python's locks are not fair), so the lock may only come free once the request finished: then
        # start over (the lock is held from the check to the update, so no step comes between them).
        for _ in range(5):
            box.clear()
            worker = threading.Thread(target=lambda: box.append(llm.generate([[1, 2, 3]], long)), daemon=True)
            worker.start()
            wait_for(lambda: llm.engine.state().num_running == 1 or bool(box))
            with llm._lock:
                running = llm.engine.state().num_running == 1
                if running:
                    with pytest.raises(CheckpointError, match="the trainer went away"):
                        llm.update_weights(stream())
            if running:
                break
            worker.join(10)
        assert running, "the request finished before the failed update could come, five times"
        assert llm.state.num_running == 1 and not llm.state.serving
        wait_for(lambda: len(llm._lock._waiters) == 1)  # the generate waits for the engine to serve
        llm.sleep(1, "abort")
        worker.join(10)
        assert not worker.is_alive(), "the generate still waits although its request was aborted"
        assert box[0][0].outputs[0].finish_reason == "abort"
    finally:
        llm.wait_if_asleep = 0.0
        llm.wake_up()
        llm.reload_weights()
        if worker is not None:
            worker.join(10)


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def starved(tiny_model_path):
    """An engine whose host budget holds no copy: every offloading sleep fails."""
    return LLM(tiny_model_path, memory=MemoryManager("cpu", max_host_bytes=1024), reserve_host_copies=False,
               **ENGINE)


@pytest.mark.parametrize("call", ["sleep 1", "sleep 2", "release_tags"])
def test_a_sleep_bound_to_fail_aborts_no_request(starved, call):
    """sleep(mode='abort') aborted the running requests, then failed for want of host memory: the engine
    served again but the requests were gone (ended 'abort'), though the failed sleep was to change nothing."""
    engine = starved.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    reference = answers([run(engine, [1, 2, 3], params)])
    engine.add_request([1, 2, 3], params)
    engine.step()  # the prefill: the request runs
    before = snapshot(starved)
    with pytest.raises(HostMemoryError, match="max_host_bytes"):
        if call == "release_tags":
            engine.release_tags(["weights"], "abort")
        else:
            engine.sleep(int(call[-1]), "abort")
    assert snapshot(starved) == before
    outputs = [o for o in drive(engine) if o.finished]
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"]
    assert answers(outputs) == reference


def run(engine, prompt, params):
    engine.add_request(prompt, params)
    return next(o for o in drive(engine) if o.finished)


def drive(engine) -> list:
    outputs = []
    while not engine.is_finished():
        outputs += engine.step()
    return outputs


def test_a_weights_group_apply_declares_its_write(llm, weight_sets, references, requests):
    """A per-rank update_weights_from_tensor and update_weights_from_distributed copy through each rank's
    `Worker.apply_staged` (what the rank received or opened): it must declare its write (mark the weights dirty),
    or after a wake (weights marked clean) the next level-1 sleep keeps the old host copy and the wake brings the
    old weights back. Run here on the one-rank engine."""
    engine = llm.engine
    llm.sleep(1)
    llm.wake_up()  # woken from the copy: the weights are marked clean
    try:
        driver = engine.executor.driver
        driver.updates._staged["review"] = list(weight_sets[1])  # what this rank received from the trainer's group
        names = [name for name, _ in weight_sets[1]]
        engine.weights.write(names, lambda: engine.executor.collective_rpc("apply_staged", ("review",))[0])
        assert generate(llm, requests) == references[1]
        llm.sleep(1)  # TORPOR_VERIFY_CLEAN_COPIES=1: a kept stale copy raises StaleCopyError here
        llm.wake_up()
        assert generate(llm, requests) == references[1]
    finally:
        llm.wake_up()
        llm.update_weights(weight_sets[0])


@pytest.mark.parametrize("seed", range(2))
def test_random_sleeps_beside_a_waiting_generate(llm, references, requests, seed):
    """One thread generates the fixed requests again and again (waiting without limit while the engine does not
    serve) while this one sleeps (any level, wait or abort), wakes selectively, reloads. No generate hangs, no
    request is lost: each answer is the reference, bit for bit, or ended 'abort' by a sleep."""
    rng = random.Random(seed)
    llm.wait_if_asleep = None
    stop, seen, wrong = threading.Event(), [], []

    def generating() -> None:
        try:
            while not stop.is_set():
                outputs = llm.generate([p for p, _ in requests], [sp for _, sp in requests])
                for output, answer, reference in zip(outputs, answers(outputs), references[0], strict=True):
                    aborted = any(sample.finish_reason == "abort" for sample in output.outputs)
                    seen.append("abort" if aborted else "answer")
                    if not aborted and answer != reference:
                        wrong.append(answer)
        except BaseException as exc:
            wrong.append(exc)

    worker = threading.Thread(target=generating, daemon=True)
    worker.start()
    try:
        for _ in range(12):
            llm.sleep(rng.choice([0, 1, 2]), rng.choice(["wait", "abort"]))
            time.sleep(0.01)
            llm.wake_up(rng.choice([None, ["weights"], ["kv_cache"]]))
            llm.wake_up()
            if not llm.state.weights_valid:
                llm.reload_weights()
            time.sleep(rng.choice([0, 0.02]))
    finally:
        stop.set()
        worker.join(30)
        llm.wait_if_asleep = 0.0
    assert not worker.is_alive(), "a generate hangs"
    assert not wrong and "answer" in seen, (len(wrong), seen.count("answer"), seen.count("abort"))
    state = llm.state
    assert state.serving and state.num_running == state.num_waiting == 0 and not llm._finished
