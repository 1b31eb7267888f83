"""The engine's one state and one text path, and hangs that are gone: every test here failed (or hung) on the
code before."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from torpor.engine import LLM, SamplingParams
from torpor.engine.tokenizer import OutputText
from torpor.memory import HostMemoryError, MemoryManager
from torpor.server.async_engine import AsyncEngine

ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=4, block_size=4)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(tiny_model_path, **ENGINE)


@pytest.fixture(autouse=True)
def awake(llm):
    yield
    llm.wait_if_asleep = 0.0
    if llm.is_sleeping():
        llm.wake_up()
    if not llm.state.weights_valid:
        llm.reload_weights()


def in_thread(fn, timeout: float = 20.0):
    """Run `fn` in a thread: (finished, result or exception). A hang shows as finished=False, not a stuck test."""
    box: list = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:
            box.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return (not thread.is_alive()), (box[0] if box else None)


# ---- 11.3: generate in a single-threaded program never blocks forever -------------------------
@pytest.mark.parametrize("level", [0, 1, 2])
def test_generate_while_asleep_raises_at_once(llm, level):
    llm.sleep(level)
    start = time.monotonic()
    done, result = in_thread(lambda: llm.generate([[5, 6, 7]], GREEDY))
    assert done and isinstance(result, RuntimeError), result
    assert time.monotonic() - start < 5
    assert "wake_up()" in str(result)
    if level == 2:
        assert "reload_weights()" in str(result)
    assert llm.engine.is_finished()  # the refused request left nothing queued
    llm.wake_up()
    if level == 2:
        llm.reload_weights()
    assert llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids


def test_generate_after_level_two_and_weights_woken_names_reload(llm):
    llm.sleep(2)
    llm.wake_up(["weights"])
    done, result = in_thread(lambda: llm.generate([[5, 6, 7]], GREEDY))
    assert done and isinstance(result, RuntimeError) and "reload_weights()" in str(result)


def test_wait_if_asleep_waits_that_long_then_raises(llm):
    llm.sleep(1)
    llm.wait_if_asleep = 0.3
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"waited 0.3 s"):
        llm.generate([[5, 6, 7]], GREEDY)
    assert 0.25 < time.monotonic() - start < 5
    with pytest.raises(ValueError, match="wait_if_asleep"):
        LLM(llm.config.model, wait_if_asleep=-1, **ENGINE)


# ---- 11.4: a failed sleep leaves the engine exactly as before ----------------------------------
@pytest.fixture
def starved(tiny_model_path):
    """An engine whose level-1 sleep cannot get host memory for its copies."""
    return LLM(tiny_model_path, memory=MemoryManager("cpu", max_host_bytes=1024), **ENGINE)


def test_failed_sleep_from_awake_keeps_serving(starved):
    reference = starved.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids
    before = starved.state
    with pytest.raises(HostMemoryError):
        starved.sleep(1)
    assert starved.state == before and before.serving and not starved.engine.lifecycle.draining
    assert starved.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids == reference


def test_failed_sleep_from_level_zero_stays_paused(starved):
    starved.sleep(0)
    before = starved.state
    with pytest.raises(HostMemoryError):
        starved.sleep(1)
    state = starved.state
    assert state == before and state.sleep_level == 0 and not state.serving
    assert not starved.engine.lifecycle.may_run() and not starved.engine.lifecycle.draining  # scheduler follows
    assert not starved.engine.has_work()
    assert starved.wake_up().serving
    assert starved.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids


def test_failed_sleep_with_the_backup_folder_gone_stays_paused(tiny_model_path, tmp_path):
    """The TMPDIR-deleted case: the level-1 sleep cannot write its host copies (none reserved ahead)."""
    folder = tmp_path / "backup"
    folder.mkdir()
    llm = LLM(tiny_model_path, memory=MemoryManager("cpu", backup_dir=str(folder)), reserve_host_copies=False,
              **ENGINE)
    llm.sleep(0)
    folder.rmdir()
    with pytest.raises(Exception, match=r"backup|No such file"):
        llm.sleep(1)
    state = llm.state
    assert state.sleep_level == 0 and not state.serving and set(state.tags.values()) == {"awake"}
    assert not llm.engine.lifecycle.draining
    folder.mkdir()
    assert llm.sleep(1) is not None and llm.wake_up().serving
    assert llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="needs Linux /proc")
def test_failed_wake_leaves_one_consistent_state(tiny_model_path, tmp_path):
    """The host copies are damaged while asleep (their files truncated through /proc): the wake fails, and
    the state says asleep and not serving, the scheduler paused, generate names what to call."""
    llm = LLM(tiny_model_path, memory=MemoryManager("cpu", backup_dir=str(tmp_path)), **ENGINE)
    llm.sleep(1)
    backups = [f"/proc/self/fd/{fd}" for fd in os.listdir("/proc/self/fd")
               if os.path.realpath(f"/proc/self/fd/{fd}").startswith(str(tmp_path))]
    assert backups
    for backup in backups:
        os.truncate(backup, 0)
    with pytest.raises(HostMemoryError, match="truncated"):
        llm.wake_up()
    state = llm.state
    assert state.sleep_level == 1 and not state.serving and "asleep" in state.tags.values()
    assert not llm.engine.lifecycle.may_run() and not llm.engine.has_work()
    with pytest.raises(RuntimeError, match=r"wake_up\(\)"):
        llm.generate([[5, 6, 7]], GREEDY)


def _cpu_seconds(native_id: int) -> float:
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_async_engine_after_failed_sleep_is_consistent_and_idle(starved):
    """The server's case: sleep(0), sleep(1) fails. /health said is_sleeping and serving at once, requests
    hung and the engine thread spun at 100% CPU."""

    async def scenario():
        engine = AsyncEngine(starved.engine)
        engine.start()
        try:
            await engine.sleep(0)
            with pytest.raises(HostMemoryError):
                await engine.sleep(1)
            assert engine.sleeping and not engine.serving  # one consistent state: paused
            stream = await engine.add_request("r1", [5, 6, 7], GREEDY)
            busy = _cpu_seconds(engine._thread.native_id)
            await asyncio.sleep(1.0)  # a request waits while paused: the thread must block, not spin
            assert _cpu_seconds(engine._thread.native_id) - busy < 0.3
            await engine.wake_up()
            assert engine.serving and not engine.sleeping
            output = await asyncio.wait_for(stream.result(), 30)
            assert len(output.outputs[0].token_ids) == GREEDY.max_tokens
        finally:
            engine.stop()

    asyncio.run(scenario())


# ---- 11.11: strict types ---------------------------------------------------------------------
def test_wake_up_refuses_a_string_and_sleep_a_bool(llm):
    llm.sleep(1)
    with pytest.raises(ValueError, match=r"list of tag names"):
        llm.wake_up("weights")  # used to iterate the characters
    assert llm.is_sleeping()
    llm.wake_up()
    with pytest.raises(ValueError, match="sleep level"):
        llm.sleep(True)
    assert llm.state.serving


def test_memory_manager_cuda_without_cuda_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    with pytest.raises(ValueError, match="CUDA is not available"):
        MemoryManager("cuda")


# ---- 12.1: one state API -------------------------------------------------------------------------
def test_state_follows_every_sleep_and_wake(llm):
    state = llm.state
    assert state.serving and state.sleep_level is None and state.weights_valid
    assert set(state.tags.values()) == {"awake"}
    llm.sleep(2)
    state = llm.state
    assert (state.serving, state.sleep_level, state.weights_valid) == (False, 2, False)
    assert state.tags["weights"] == state.tags["kv_cache"] == "asleep"
    llm.wake_up(["weights"])
    assert llm.state.tags["weights"] == "awake" and llm.state.sleep_level == 2
    llm.reload_weights()
    assert not llm.state.serving  # the KV cache still sleeps
    result = llm.wake_up(["kv_cache"])
    assert result.serving and llm.state.serving and llm.state.weights_valid
    usage = llm.memory_usage()
    assert usage["level"] is None and "ranks" not in usage  # "ranks" only under tensor parallelism


# ---- 12.2: text deltas built once, stop strings respected ---------------------------------------
def test_streamed_deltas_add_up_and_never_show_a_stop_string(llm):
    prompt = [5, 6, 7, 8]
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    stop = full.text[len(full.text) // 2:][:3]
    assert len(stop) == 3
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop], logprobs=1)
    with llm._lock:
        request_id = engine.add_request(prompt, params, stream=True)
        outputs = []
        while not (outputs and outputs[-1].finished):
            outputs += [o for o in engine.step() if o.request_id == request_id]
    final = outputs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == full.text[:full.text.index(stop)]
    assert "".join(o.outputs[0].delta_text for o in outputs) == final.text
    assert [t for o in outputs for t in o.outputs[0].delta_token_ids] == final.token_ids
    assert sum(len(o.outputs[0].delta_logprobs) for o in outputs) == len(final.token_ids)
    for output in outputs[:-1]:
        assert not output.finished and stop not in output.outputs[0].text


def test_output_text_holds_back_a_possible_stop_string(tiny_model_path):
    from torpor.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(tiny_model_path)
    ids = tokenizer.encode("hello world, good night", add_special_tokens=False)
    text = OutputText(tokenizer, SamplingParams(stop="good night"), incremental=True)
    emitted = ""
    for n in range(1, len(ids) + 1):
        stop = text.update(ids[:n])
        emitted += text.delta()
        assert "good" not in emitted  # "good" may begin the stop string: held back
        if stop:
            break
    assert stop == "good night"
    emitted += text.delta(text.final(ids))
    assert emitted == text.final(ids) == "hello world, "


# ---- 12.3 / 11.8: one validation, prompt + max_tokens within max_model_len -----------------------
def test_prompt_and_max_tokens_beyond_max_model_len_is_refused(llm):
    with pytest.raises(ValueError, match=r"beyond max_model_len \(64\)"):
        llm.engine.make_sequence(list(range(1, 41)), SamplingParams(max_tokens=30))
    assert llm.engine.make_sequence(list(range(1, 41)), SamplingParams(max_tokens=24))
    with pytest.raises(ValueError, match="request_id"):
        llm.engine.make_sequence([1, 2], None, request_id="")
