"""pause_generation / resume_generation in the engine and in `LLM` (the tiny fp32 model on CPU), every mode, and the
weights' labels per output token (vLLM's `weight_versions`): a request paused with "keep" across a weight update is
served by the old weights before it and by the new ones after it, span by span; with clear_cache its KV is
recomputed by the new weights (the tokens equal an engine started on them from the same tokens), without it the KV of
its earlier tokens is kept."""

import threading
import time

import pytest
from server_thread import wait_for

from torpor.engine import LLM, SamplingParams
from torpor.engine.lifecycle import LifecycleError
from torpor.engine.outputs import WeightVersionSpan
from torpor.engine.sequence import SequenceStatus
from torpor.engine.weights.loader import iter_checkpoint
from torpor.synthetic import make_model

ENGINE = dict(device="cpu", dtype="float32", max_model_len=96, max_num_seqs=8, block_size=4)
PROMPT = [5, 6, 7, 8, 9, 10]
N = 24  # output tokens per request


def greedy(max_tokens: int = N, **options) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **options)


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory) -> str:
    return str(make_model("tiny", tmp_path_factory.mktemp("tiny-seed3") / "tiny", seed=3, dtype="float32",
                          progress=False))


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(tiny_model_path, **ENGINE)


@pytest.fixture
def engine(llm, tiny_model_path):
    """The module's engine, idle, unpaused, awake, on the old weights labelled "default" after each test."""
    engine = llm.engine
    yield engine
    engine.abort_requests(None)
    engine.step()
    engine.resume_generation()
    if engine.is_sleeping():
        engine.wake_up()
    if engine.weight_version != "default":
        engine.update_weights(list(iter_checkpoint(tiny_model_path)))
        engine.update_weight_version("default")
    assert engine.serving and engine.is_finished()


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    """What the old weights answer, uninterrupted."""
    return LLM(tiny_model_path, **ENGINE).generate([PROMPT], greedy(), use_tqdm=False)[0].outputs[0]


def step_until(engine, request_id: str, num_tokens: int) -> None:
    """Step until the request's first sample has `num_tokens` output tokens."""
    seq = engine.scheduler.samples(request_id)[0]
    while seq.num_output_tokens < num_tokens:
        engine.step()


def finish(engine) -> dict:
    """Step until every request finished; their final outputs by id."""
    done = {}
    deadline = time.monotonic() + 60
    while not engine.is_finished() or engine.has_pending_outputs():
        assert time.monotonic() < deadline, "the engine did not finish its requests"
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done


def test_abort_ends_every_request_with_its_tokens_and_new_ones_wait(engine):
    engine.add_request(PROMPT, greedy(logprobs=1), "running")
    step_until(engine, "running", 3)
    engine.add_request([1, 2, 3], greedy(4), "queued")  # waits: max_num_seqs is not the limit, the pause is
    seq = engine.scheduler.samples("running")[0]
    tokens = seq.output_token_ids
    engine.pause_generation("abort")
    assert engine.is_paused() and engine.state().paused == "new" and engine.is_finished()
    outputs = {o.request_id: o for o in engine.step()}
    aborted = outputs["running"].outputs[0]
    assert aborted.finish_reason == "abort" and aborted.token_ids == tokens and len(aborted.logprobs) == len(tokens)
    assert aborted.weight_versions == [WeightVersionSpan("default", 0, len(tokens))]
    assert outputs["queued"].outputs[0].finish_reason == "abort"
    assert outputs["queued"].outputs[0].token_ids == [] and outputs["queued"].outputs[0].weight_versions == []
    engine.add_request([1, 2, 3], greedy(4), "after")
    for _ in range(3):
        assert engine.step() == [] and engine.scheduler.samples("after")[0].status is SequenceStatus.WAITING
    engine.resume_generation()
    assert not engine.is_paused()
    assert finish(engine)["after"].outputs[0].finish_reason == "length"


def test_wait_lets_the_running_finish_and_starts_none(engine, reference):
    engine.add_request(PROMPT, greedy(), "running")
    step_until(engine, "running", 2)
    engine.add_request([1, 2, 3], greedy(4), "queued")  # not started before the pause: waits
    engine.pause_generation("wait")
    assert engine.is_paused() and not engine.scheduler.running
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["running"].outputs[0].token_ids == reference.token_ids
    assert engine.scheduler.samples("queued")[0].status is SequenceStatus.WAITING
    engine.resume_generation()
    assert finish(engine)["queued"].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("mode", ["keep", "in_place", "retract"])
def test_keep_and_retract_continue_after_the_resume(engine, reference, mode):
    engine.add_request(PROMPT, greedy(), "a")
    step_until(engine, "a", 5)
    seq = engine.scheduler.samples("a")[0]
    blocks = list(seq.block_table)
    engine.pause_generation(mode, clear_cache=False)
    assert engine.state().paused == "all"
    if mode == "retract":  # back in the queue, its KV gone
        assert seq.status is SequenceStatus.WAITING and seq.block_table == []
    else:  # frozen with its KV
        assert seq.status is SequenceStatus.RUNNING and seq.block_table == blocks
    for _ in range(3):
        assert engine.step() == [] and seq.num_output_tokens == 5
    engine.resume_generation()
    out = finish(engine)["a"].outputs[0]
    assert out.token_ids == reference.token_ids and out.weight_versions == [WeightVersionSpan("default", 0, N)]


def test_keep_across_a_weight_update_span_by_span(engine, new_weights, tiny_model_path):
    """clear_cache=True (vLLM's default): the tokens before the update are the old weights' answer; the tokens after
    it are the new weights' continuation of prompt + those tokens (the KV is recomputed by them)."""
    old = LLM(tiny_model_path, **ENGINE).generate([PROMPT], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request(PROMPT, greedy(), "a")
    step_until(engine, "a", 7)
    seq = engine.scheduler.samples("a")[0]
    engine.pause_generation("keep")  # clear_cache=True: recomputed after the resume
    assert seq.status is SequenceStatus.WAITING and seq.block_table == []
    engine.update_weights(list(iter_checkpoint(new_weights)))
    engine.update_weight_version("step-1")
    engine.resume_generation()
    out = finish(engine)["a"].outputs[0]
    (before, after) = out.weight_versions
    assert (before, after) == (WeightVersionSpan("default", 0, 7), WeightVersionSpan("step-1", 7, N))
    assert out.token_ids[:7] == old[:7]
    continued = LLM(new_weights, **ENGINE).generate([PROMPT + out.token_ids[:7]], greedy(N - 7), use_tqdm=False)
    assert out.token_ids[7:] == continued[0].outputs[0].token_ids
    assert out.token_ids[7:] != old[7:]  # the new weights answer otherwise


def test_keep_without_clear_cache_keeps_the_old_kv(engine, llm, new_weights, tiny_model_path):
    """clear_cache=False: the request keeps its blocks through the pause and the update (the KV of its earlier
    tokens is the old weights'); it answers as an engine whose weights change between two of its steps."""
    engine.add_request(PROMPT, greedy(), "a")
    step_until(engine, "a", 7)
    seq = engine.scheduler.samples("a")[0]
    blocks, cached = list(seq.block_table), seq.num_cached_tokens
    engine.pause_generation("keep", clear_cache=False)
    engine.update_weights(list(iter_checkpoint(new_weights)))
    engine.update_weight_version("step-1")
    assert (seq.status, seq.block_table, seq.num_cached_tokens) == (SequenceStatus.RUNNING, blocks, cached)
    engine.resume_generation()
    out = finish(engine)["a"].outputs[0]
    assert out.weight_versions == [WeightVersionSpan("default", 0, 7), WeightVersionSpan("step-1", 7, N)]
    in_flight = LLM(tiny_model_path, **ENGINE).engine  # the same request, its weights swapped between two steps
    in_flight.add_request(PROMPT, greedy(), "a")
    step_until(in_flight, "a", 7)
    in_flight.update_weights(list(iter_checkpoint(new_weights)))
    assert finish(in_flight)["a"].outputs[0].token_ids == out.token_ids


def test_wait_that_cannot_finish_is_refused_and_changes_nothing(engine):
    engine.add_request(PROMPT, greedy(), "a")
    step_until(engine, "a", 2)
    engine.sleep(0, mode="keep")  # frozen at level 0
    seq = engine.scheduler.samples("a")[0]
    with pytest.raises(LifecycleError, match="cannot finish"):
        engine.pause_generation("wait")
    assert not engine.is_paused()
    with pytest.raises(LifecycleError, match="cannot finish"):
        engine.sleep(1, mode="wait")
    assert engine.lifecycle.level == 0 and seq.status is SequenceStatus.RUNNING
    with pytest.raises(ValueError, match="retract"):
        engine.pause_generation("later")


@pytest.mark.parametrize("level", [0, 1, 2])
def test_sleep_keep_continues_the_running_after_the_wake(engine, reference, tiny_model_path, level):
    engine.add_request(PROMPT, greedy(), "a")
    step_until(engine, "a", 5)
    seq = engine.scheduler.samples("a")[0]
    engine.sleep(level, mode="keep")
    assert seq.status is (SequenceStatus.RUNNING if level == 0 else SequenceStatus.WAITING)
    assert engine.step() == [] and seq.num_output_tokens == 5
    engine.wake_up(["scheduling"] if level == 0 else None)
    if level == 2:
        engine.reload_weights()
    out = finish(engine)["a"].outputs[0]
    assert out.token_ids == reference.token_ids and out.finish_reason == "length"


def test_reset_prefix_cache_of_running_requests_recomputes_them(engine, reference):
    engine.add_request(PROMPT, greedy(), "a")
    step_until(engine, "a", 4)
    seq = engine.scheduler.samples("a")[0]
    assert engine.reset_prefix_cache(reset_running_requests=True)
    assert seq.status is SequenceStatus.WAITING and seq.block_table == []
    assert finish(engine)["a"].outputs[0].token_ids == reference.token_ids


def test_llm_pause_from_another_thread(tiny_model_path):
    """`LLM.generate` in one thread, pause / resume / abort from another (generate waits while paused)."""
    long = 400  # tokens: the pause comes long before the end
    llm = LLM(tiny_model_path, wait_if_asleep=None, **{**ENGINE, "max_model_len": 512})
    expected = llm.generate([PROMPT], greedy(long), use_tqdm=False)[0].outputs[0].token_ids
    results = {}

    def generate(key: str, params: SamplingParams) -> None:
        results[key] = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]

    worker = threading.Thread(target=generate, args=("keep", greedy(long)))
    worker.start()
    wait_for(lambda: any(s.num_output_tokens > 1 for s in list(llm.engine.scheduler.running)), what="tokens")
    llm.pause_generation("keep", clear_cache=False)
    (seq,) = llm.engine.scheduler.running
    frozen = seq.num_output_tokens
    assert llm.is_paused() and worker.is_alive() and frozen < long  # generate waits, nothing runs
    assert llm.engine.step() == [] and seq.num_output_tokens == frozen
    llm.resume_generation()
    worker.join(60)
    assert results["keep"].token_ids == expected
    worker = threading.Thread(target=generate, args=("abort", greedy(long)))
    worker.start()
    wait_for(lambda: any(s.num_output_tokens > 1 for s in list(llm.engine.scheduler.running)), what="tokens")
    assert llm.abort_requests() == 1  # not paused: just ended
    worker.join(60)
    assert results["abort"].finish_reason == "abort" and 1 < len(results["abort"].token_ids) < long
    assert not llm.is_paused()
    llm.update_weight_version("v7")
    assert llm.get_weight_version() == "v7"
    assert llm.generate([PROMPT], greedy(3), use_tqdm=False)[0].outputs[0].weight_versions == [
        WeightVersionSpan("v7", 0, 3)]


def test_llm_request_ids_abort_one_and_wait_if_paused(tiny_model_path):
    """`generate(request_ids=...)`: checked, refused while taken, abortable one by one from another thread; with
    `wait_if_paused` a request sent during a pause waits for the resume while a sleep still refuses at once."""
    long = 400
    llm = LLM(tiny_model_path, wait_if_asleep=0, wait_if_paused=60, **{**ENGINE, "max_model_len": 512})
    for ids, message in ((["a"], "one id per prompt"), (["a", "a"], "appears twice"), (["a", ""], "non-empty")):
        with pytest.raises(ValueError, match=message):
            llm.generate([PROMPT, PROMPT], greedy(2), use_tqdm=False, request_ids=ids)
    expected = llm.generate([PROMPT], greedy(long), use_tqdm=False)[0].outputs[0].token_ids
    results = {}

    def generate(key: str, ids: list[str], params: SamplingParams, count: int = 2) -> None:
        results[key] = llm.generate([PROMPT] * count, params, use_tqdm=False, request_ids=ids)

    worker = threading.Thread(target=generate, args=("two", ["x", "y"], greedy(long)))
    worker.start()
    wait_for(lambda: sum(s.num_output_tokens > 1 for s in list(llm.engine.scheduler.running)) == 2, what="tokens")
    with pytest.raises(ValueError, match="'x' already running"):
        llm.generate([PROMPT], greedy(2), use_tqdm=False, request_ids=["x"])
    assert llm.abort_requests(["x", "nobody"]) == 1  # only x: y runs on to its end
    worker.join(60)
    x, y = (o.outputs[0] for o in results["two"])
    assert x.finish_reason == "abort" and 1 < len(x.token_ids) < long
    assert y.finish_reason == "length" and y.token_ids == expected

    llm.pause_generation("abort")
    worker = threading.Thread(target=generate, args=("held", ["h"], greedy(3), 1))
    worker.start()
    wait_for(lambda: llm.engine.request_ids() == ["h"], what="the held request queued")
    time.sleep(0.3)
    assert worker.is_alive() and "held" not in results  # waits for the resume, does not raise
    llm.resume_generation()
    worker.join(60)
    assert results["held"][0].outputs[0].token_ids == expected[:3]
    llm.sleep(1)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"generate: the engine sleeps \(level 1"):
        llm.generate([PROMPT], greedy(3), use_tqdm=False)  # wait_if_asleep=0: at once
    assert time.monotonic() - start < 5
    llm.wake_up()
    with pytest.raises(ValueError, match="wait_if_paused must be a number of seconds"):
        LLM(tiny_model_path, wait_if_paused=-1, **ENGINE)
    llm.close()
