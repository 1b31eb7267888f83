"""Sleep mode of the engine on CPU: the bit-exact harness, the soak, and the lifecycle edge cases."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from torpor.engine import LLM, SamplingParams
from torpor.engine.weights.loader import iter_checkpoint
from torpor.testing.harness import differences, fixed_requests, run_harness, run_round, soak

MiB = 2**20


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(tiny_model_path, device="cpu", max_num_seqs=32, max_model_len=256)


@pytest.fixture(autouse=True)
def awake(llm):
    yield
    if llm.is_sleeping():  # a failed test must not leave the shared engine asleep
        llm.wake_up()
    if llm.engine.lifecycle.weights_discarded:
        llm.reload_weights()


@pytest.fixture(scope="module")
def requests(llm):
    return fixed_requests(64, llm.engine.vocab_size, max_prompt=40, max_tokens=12)


def test_every_tag_holds_its_buffers(llm):
    tags = llm.memory_usage()["tags"]
    assert {"weights", "kv_cache", "runtime"} <= tags.keys()
    assert all(tags[t]["allocated_bytes"] > 0 for t in ("weights", "kv_cache", "runtime"))


def test_bit_exact_after_every_kind_of_wake(llm, requests):
    results = run_harness(llm, requests, log=lambda line: None)
    assert [s.name for s in results if s.mismatches] == []
    assert len(results) == 6


def test_soak_exact_and_flat(llm, requests):
    result = soak(llm, requests[:8], cycles=18)
    assert result.exact_cycles == 18
    assert abs(result.slope(result.host_rss_bytes[3:])) < 1.0  # MiB per cycle, after warm-up


def test_sleep_releases_memory_and_reports_it(llm):
    with torch.no_grad():
        llm.engine.executor.driver.runner.kv_cache[0][0].fill_(1.0)  # touch KV pages so there is RSS to give back
    before = llm.memory_usage()
    report = llm.sleep(1)
    asleep = llm.memory_usage()
    assert report.bytes_released > 0 and report.bytes_copied > 0
    assert asleep["level"] == 1 and llm.is_sleeping()
    assert {t: u["state"] for t, u in asleep["tags"].items()} == dict.fromkeys(asleep["tags"], "asleep")
    assert asleep["tags"]["kv_cache"]["discarded_bytes"] == before["tags"]["kv_cache"]["reserved_bytes"]
    assert asleep["tags"]["weights"]["offloaded_bytes"] == before["tags"]["weights"]["reserved_bytes"]
    assert asleep["device_used_bytes"] < before["device_used_bytes"]
    llm.wake_up()
    assert not llm.is_sleeping()


def test_double_sleep_and_wake_are_noops_deeper_drops_copy(llm, requests):
    reference = run_round(llm, requests[:6])
    assert llm.sleep(1) is not None
    assert llm.sleep(1) is None  # double
    assert llm.memory_usage()["tags"]["weights"]["host_backup_bytes"] > 0
    llm.sleep(2)  # deeper: the weights' host copy goes
    assert llm.memory_usage()["tags"]["weights"]["host_backup_bytes"] == 0
    assert llm.sleep(1) is None  # shallower
    llm.wake_up(["weights"])
    llm.reload_weights()
    llm.wake_up(["kv_cache"])
    assert llm.wake_up().woken == ()  # double wake
    assert not differences(reference, run_round(llm, requests[:6]))


def test_sleep_right_after_start_up(tiny_model_path):
    llm = LLM(tiny_model_path, device="cpu", max_num_seqs=4, max_model_len=128)
    llm.sleep(1)
    llm.wake_up()
    first = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
    llm.sleep(1)
    llm.wake_up()
    again = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids


def test_level_zero_pauses_only(llm):
    usage = llm.memory_usage()
    assert llm.sleep(0) is None
    assert llm.is_sleeping() and llm.memory_usage()["tags"] == usage["tags"]
    result = llm.wake_up()
    assert result.serving and not llm.is_sleeping()


def test_requests_wait_while_asleep_and_finish_after_full_wake(llm, requests):
    reference = run_round(llm, requests[:4])
    llm.sleep(1)
    llm.wait_if_asleep = None  # this program wakes the engine from another thread: wait without limit
    results: list = []
    worker = threading.Thread(target=lambda: results.append(run_round(llm, requests[:4])))
    worker.start()
    time.sleep(0.3)
    assert worker.is_alive()  # asleep: the request waits
    llm.wake_up(["weights"])
    time.sleep(0.3)
    assert worker.is_alive()  # weights only: the KV cache still sleeps
    llm.wake_up(["kv_cache"])
    worker.join(timeout=60)
    llm.wait_if_asleep = 0.0
    assert not worker.is_alive() and not differences(reference, results[0])


def test_running_requests_wait_or_abort(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for mode, reason in (("wait", "length"), ("abort", "abort")):
        ids = [engine.add_request([3, 4, 5, i], params) for i in range(3)]
        engine.step()  # prefill: the requests are running
        engine.step()
        llm.sleep(1, mode=mode)
        finished = {o.request_id: o for o in engine.step()}  # what the sleep finished comes out here
        assert set(finished) == set(ids)
        assert {o.outputs[0].finish_reason for o in finished.values()} == {reason}
        if mode == "wait":
            assert all(len(o.outputs[0].token_ids) == 20 for o in finished.values())
        llm.wake_up()


def test_weights_must_be_restored_after_level_two(llm):
    llm.sleep(2)
    with pytest.raises(RuntimeError, match=r"wake_up\(\['weights'\]\) first"):
        llm.reload_weights()
    result = llm.wake_up()
    assert not result.serving  # every tag awake, but the weights are zeros
    with pytest.raises(RuntimeError, match="reload_weights"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert llm.update_weights([]) == 0  # after a level-2 sleep every weight must come: none did
    assert not llm.state.serving and "tensors not written since" in llm.state.not_serving_reason()
    assert llm.update_weights(iter_checkpoint(llm.config.model)) > 0
    assert llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids


def test_bad_sleep_input(llm):
    with pytest.raises(ValueError, match="sleep level must be one of 0, 1, 2, 3, 4"):
        llm.sleep(5)
    with pytest.raises(ValueError, match="sleep level must be"):
        llm.sleep(True)
    with pytest.raises(ValueError, match="mode"):
        llm.sleep(1, mode="later")
    llm.sleep(1)
    with pytest.raises(ValueError, match="unknown tag"):
        llm.wake_up(["brain"])
    llm.wake_up()


def test_sleep_mode_off(tiny_model_path):
    llm = LLM(tiny_model_path, device="cpu", max_num_seqs=2, max_model_len=64, enable_sleep_mode=False)
    with pytest.raises(RuntimeError, match="sleep mode is off"):
        llm.sleep(1)
