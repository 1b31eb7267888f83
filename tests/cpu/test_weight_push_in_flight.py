"""Pushes with requests in flight (torpor/server/weight_pipeline.py, `WeightReceiver.stage` / `apply_staged`,
`WeightPusher(in_flight=...)`) against a real server (uvicorn in a thread, the tiny fp32 model on CPU) and, for
the trainer that dies and the memory it gets back, a trainer process.

The guarantees of a push in one request at a time hold with several in flight: each request is checked before a
byte of it is written; a push's requests are applied in index order whatever order they arrive in; none after
the first that failed writes anything (a refused bucket in the middle, a copy that fails on the engine thread);
after a level-2 sleep the engine serves only once every tensor came (a trainer that dies mid-push, a sleep that
arrives mid-push); a payload opened off the engine thread is released, unwritten, when the weights go to sleep
before its copy, and no payload is opened while a sleep or wake runs."""

import asyncio
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
import torch
from server_thread import ServerThread, wait_for

from torpor.engine import LLM, SamplingParams
from torpor.engine.weights import shm
from torpor.engine.weights.loader import iter_checkpoint
from torpor.rl import WeightPusher, bucket_named_tensors, serialize
from torpor.server import ServerConfig, build_app, weight_pipeline
from torpor.synthetic import make_model

ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=8, block_size=4)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [7, 8, 9]]
ADMIN = "admin-secret"
SMALL = 40_000  # bytes per bucket: the tiny model in ~10 requests
IDLE_S = 1.0  # a push that sends nothing for this long is given up
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def new_weights_path(tmp_path_factory) -> str:
    return str(make_model("tiny", tmp_path_factory.mktemp("tiny-seed2") / "tiny", seed=2, dtype="float32",
                          progress=False))


@pytest.fixture(scope="module")
def server(tiny_model_path):
    llm = LLM(tiny_model_path, **ENGINE)
    config = ServerConfig("tiny", admin_token=ADMIN, max_body_bytes=1 << 20, push_idle_timeout_s=IDLE_S)
    app = build_app(llm.engine, config)
    with ServerThread(app) as url:
        admin = httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {ADMIN}"})
        yield SimpleNamespace(url=url, llm=llm, state=app.state.server, admin=admin)


@pytest.fixture(scope="module")
def expected(tiny_model_path, new_weights_path) -> SimpleNamespace:
    return SimpleNamespace(old=_answers(LLM(tiny_model_path, **ENGINE)), new=_answers(LLM(new_weights_path, **ENGINE)))


@pytest.fixture
def old_weights(server, tiny_model_path):
    """Every test starts and ends with the old weights, awake and serving."""
    yield
    server.admin.post("/wake_up")
    WeightPusher(server.url, ADMIN, in_flight=1).push(iter_checkpoint(tiny_model_path))
    assert server.admin.get("/health").json()["serving"]


def _answers(llm) -> list:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _served(server) -> list:
    out = []
    for prompt in PROMPTS:
        r = server.admin.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 12,
                                                      "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["token_ids"])
    return out


def _weights(server) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in server.llm.engine.executor.driver.runner.model.named_parameters()}


def _post(server, payload: dict, push_id: str | None, index: int, flush: bool = False,
          last: bool = False) -> httpx.Response:
    headers = {} if push_id is None else {"X-Torpor-Push-Id": push_id, "X-Torpor-Push-Index": str(index)}
    if last:
        headers["X-Torpor-Push-Last"] = "1"
    return server.admin.post("/update_weights_from_tensor", headers=headers, json={
        "serialized_named_tensors": [serialize(payload)], "load_format": "flattened_bucket", "flush_cache": flush})


def _buckets(path: str, bucket_bytes: int = SMALL) -> list:
    return list(bucket_named_tensors(iter_checkpoint(path), bucket_bytes))


# ---- a whole push with requests in flight ------------------------------------------------------------
def test_a_push_in_flight_lands_whole_and_stages_off_the_engine_thread(server, new_weights_path, expected,
                                                                        old_weights):
    report = WeightPusher(server.url, ADMIN, bucket_bytes=SMALL, in_flight=2).push(iter_checkpoint(new_weights_path))
    assert report.in_flight == 2 and report.requests == report.buckets >= 8
    assert _served(server) == expected.new
    phases = report.engine_phases
    assert {"finite", "copy", "release", "total"} <= set(phases)
    assert {"stage", "stage_decode", "stage_check", "stage_plan"} <= set(phases)  # some requests were staged
    assert server.llm.engine.weights._staged == []  # nothing staged is left holding the trainer's memory


def test_requests_of_one_push_apply_in_index_order(server, new_weights_path, old_weights):
    """Request 1 arrives first and waits for request 0: both name the same tensor, the later index wins."""
    name = "model.norm.weight"
    norm = dict(iter_checkpoint(new_weights_path))[name]
    first, second = (bucket_named_tensors([(name, norm * k)], 1 << 20).__next__() for k in (2.0, 3.0))
    with ThreadPoolExecutor(1) as pool:
        late = pool.submit(_post, server, second.payload(), "order", 1, last=True)
        time.sleep(0.3)
        assert not late.done()  # waiting for request 0
        assert _post(server, first.payload(), "order", 0).status_code == 200
        assert late.result().status_code == 200, late.result().text
    assert torch.equal(_weights(server)[name], norm * 3.0)


def test_a_missing_request_times_out_and_fails_the_push(server, new_weights_path, monkeypatch, old_weights):
    monkeypatch.setattr(weight_pipeline, "TURN_TIMEOUT_S", 0.5)
    before = _weights(server)
    bucket = _buckets(new_weights_path)[1]
    r = _post(server, bucket.payload(), "gap", 1)
    assert r.status_code == 409 and "request 0 of this push never came" in r.text
    assert _post(server, bucket.payload(), "gap", 2).status_code == 409  # the push failed from request 1 on
    assert all(torch.equal(before[n], p) for n, p in _weights(server).items())


def test_malformed_push_headers_are_a_400(server, new_weights_path):
    payload = {"serialized_named_tensors": [serialize(_buckets(new_weights_path)[0].payload())],
               "load_format": "flattened_bucket"}
    for headers in ({"X-Torpor-Push-Id": "a"}, {"X-Torpor-Push-Id": "a", "X-Torpor-Push-Index": "-1"},
                    {"X-Torpor-Push-Index": "0"}, {"X-Torpor-Push-Id": "a", "X-Torpor-Push-Index": "0",
                                                   "X-Torpor-Push-Keep": "many"},
                    {"X-Torpor-Push-Id": "a", "X-Torpor-Push-Index": "0", "X-Torpor-Push-Last": "yes"}):
        r = server.admin.post("/update_weights_from_tensor", headers=headers, json=payload)
        assert r.status_code == 400 and "x-torpor-push" in r.text, (headers, r.text)


# ---- buffers reused through a push (torpor.rl.BucketRing, X-Torpor-Push-Keep / -Last) ----------------
def test_a_push_through_reused_buffers_maps_each_once_and_keeps_nothing_after_it(server, new_weights_path, expected,
                                                                                  monkeypatch, old_weights):
    """`push` flattens the buckets into `in_flight + 2` buffers in turn: the engine maps each shared-memory file
    once per push (not once per request), keeps those mappings between requests, and lets them go with the last."""
    opened, kept_midway = [], []  # the engine's new mappings of a trainer's file
    new_mapping = shm._map
    monkeypatch.setattr(shm, "_map", lambda handle, nbytes: (opened.append(handle), new_mapping(handle, nbytes))[1])
    pusher = WeightPusher(server.url, ADMIN, bucket_bytes=8_000, in_flight=2)
    post = pusher._post

    def noting(request, headers):
        kept_midway.append(server.llm.engine.weights.kept(headers["X-Torpor-Push-Id"]))
        return post(request, headers)

    pusher._post = noting
    report = pusher.push(iter_checkpoint(new_weights_path))
    assert report.requests >= 20
    assert 1 <= len(opened) <= 2 * 4 < report.requests  # 4 buffers, each grown at most once
    assert len(set(opened)) == len(opened)  # and each mapped once
    assert max(kept_midway) >= 2 and server.llm.engine.weights.kept() == 0
    assert _served(server) == expected.new


def test_kept_mappings_go_with_a_sleep_and_with_a_push_that_stops(server, new_weights_path, monkeypatch,
                                                                  old_weights):
    """A push that keeps its buffers mapped and then sends nothing more (its trainer died) keeps nothing after
    the idle timeout; a sleep of the weights releases the mappings at once."""
    receiver = server.llm.engine.weights
    buckets = _buckets(new_weights_path)
    for push_id in ("stops", "sleeps"):
        for index in range(2):
            headers = {"X-Torpor-Push-Id": push_id, "X-Torpor-Push-Index": str(index), "X-Torpor-Push-Keep": "4"}
            r = server.admin.post("/update_weights_from_tensor", headers=headers, json={
                "serialized_named_tensors": [serialize(buckets[index].payload())], "load_format": "flattened_bucket"})
            assert r.status_code == 200, r.text
        assert receiver.kept(push_id) == 2
        if push_id == "sleeps":
            assert server.admin.post("/sleep", params={"level": 1}).status_code == 200
            assert receiver.kept() == 0
            assert server.admin.post("/wake_up").status_code == 200
        else:
            wait_for(lambda: receiver.kept("stops") == 0, 30, "the idle push's mappings to go")


# ---- failures in the middle of a push -------------------------------------------------------------
def _bad_shape(bucket):
    name, shape, dtype, start, end = bucket.metadata[0]
    bucket.metadata[0] = (name, [*shape[:-1], shape[-1] // 2], dtype, start, start + (end - start) // 2)
    return bucket


def _non_finite(bucket):
    bucket.flattened[: 64].view(torch.float32)[0] = float("nan")
    return bucket


@pytest.mark.parametrize("spoil, failing", [(_bad_shape, 1), (_non_finite, 1), (_non_finite, 0)],
                         ids=["refused-when-staged", "non-finite-when-staged", "non-finite-first-request"])
def test_nothing_after_a_failed_request_is_written(server, tiny_model_path, new_weights_path, spoil, failing,
                                                   old_weights):
    """Request `failing` of 6 fails (request 0 runs on the engine thread: nothing else was in flight when it came;
    the others are staged); the requests after it are all sent at once, in flight while it fails: none of them
    writes a byte, and the requests before it landed."""
    buckets = _buckets(new_weights_path)[:6]
    spoil(buckets[failing])
    before = _weights(server)
    push_id = f"fail-{spoil.__name__}-{failing}"
    with ThreadPoolExecutor(6) as pool:
        first = pool.submit(_post, server, buckets[0].payload(), push_id, 0)
        if failing:
            assert first.result().status_code == 200, first.result().text
        answers = [first, *(pool.submit(_post, server, b.payload(), push_id, i) for i, b in enumerate(buckets) if i)]
        answers = [a.result() for a in answers]
    assert answers[failing].status_code == 400, answers[failing].text
    for later in answers[failing + 1:]:
        assert later.status_code == 409 and f"request {failing} of this push failed" in later.text, later.text
    # Never a mix served: the requests before the failed one wrote their tensors (no current host copy to undo them
    # with), so the engine does not serve until a complete update; with none before it, nothing happened.
    assert server.admin.get("/health").json()["serving"] == (failing == 0)
    reference = LLM(tiny_model_path, **ENGINE)  # the old weights with the requests before the failed one
    for bucket in _buckets(new_weights_path)[:failing]:
        reference.update_weights_from_tensor(bucket.payload(), load_format="flattened_bucket")
    expected = dict(reference.engine.executor.driver.runner.model.named_parameters())
    after = _weights(server)
    assert all(torch.equal(after[n], expected[n]) for n in after)
    assert any(not torch.equal(after[n], before[n]) for n in after) == (failing > 0)
    assert server.llm.engine.weights._staged == []


def test_requests_queued_behind_a_failing_copy_write_nothing(server, tiny_model_path, new_weights_path, old_weights):
    """Deterministic: the engine thread is held while request 0 (non-finite, run on the engine thread) and
    requests 1-3 (staged) are queued behind it; then request 0 fails and 1-3, already queued, write nothing."""
    buckets = _buckets(new_weights_path)[:4]
    _non_finite(buckets[0])
    before, release = _weights(server), threading.Event()
    engine = server.state.engine
    asyncio.run_coroutine_threadsafe(_hold(engine, release), engine._loop)
    with ThreadPoolExecutor(4) as pool:
        answers = [pool.submit(_post, server, buckets[0].payload(), "queued", 0)]
        wait_for(lambda: server.state.weights is not None and "queued" in server.state.weights._pushes, 30, "request 0")
        order = server.state.weights._pushes["queued"]
        wait_for(lambda: order.next == 1, 30, "request 0 queued")
        answers += [pool.submit(_post, server, b.payload(), "queued", i) for i, b in enumerate(buckets) if i]
        wait_for(lambda: order.next == 4, 30, "requests 1-3 staged and queued")
        assert len(server.llm.engine.weights._staged) == 3
        release.set()
        answers = [a.result() for a in answers]
    assert answers[0].status_code == 400 and "non-finite" in answers[0].text, answers[0].text
    assert all(a.status_code == 409 and "request 0 of this push failed" in a.text for a in answers[1:])
    assert all(torch.equal(before[n], p) for n, p in _weights(server).items())
    assert server.llm.engine.weights._staged == []


async def _hold(engine, release: threading.Event) -> None:
    """Keep the engine thread busy until `release` is set."""
    await engine.submit(release.wait, 60)


def test_a_failed_push_after_a_level_2_sleep_never_serves_and_the_next_push_lands(server, new_weights_path, expected,
                                                                                   old_weights):
    assert server.admin.post("/sleep", params={"level": 2}).status_code == 200
    assert server.admin.post("/wake_up", params={"tags": "weights"}).status_code == 200
    buckets = _buckets(new_weights_path)
    _bad_shape(buckets[3])
    pusher = WeightPusher(server.url, ADMIN, in_flight=2)
    with pytest.raises(RuntimeError, match=r"failed \(400\)"):
        pusher.push_buckets(buckets)
    assert not server.admin.post("/wake_up", params={"tags": "kv_cache"}).json()["serving"]  # half a model
    report = WeightPusher(server.url, ADMIN, bucket_bytes=SMALL, in_flight=2).push(iter_checkpoint(new_weights_path))
    assert report.requests > 3  # a second push, right after the failed one: a push of its own
    assert server.admin.get("/health").json()["serving"]
    assert _served(server) == expected.new


def test_two_pushes_at_once_each_land_in_order(server, tiny_model_path, new_weights_path, expected, old_weights):
    """Two trainers push the same new weights at once, each with 2 requests in flight: both succeed."""
    with ThreadPoolExecutor(2) as pool:
        reports = [pool.submit(WeightPusher(server.url, ADMIN, bucket_bytes=SMALL, in_flight=2).push,
                               iter_checkpoint(new_weights_path)) for _ in range(2)]
        reports = [r.result() for r in reports]
    assert all(r.requests == reports[0].requests for r in reports)
    assert _served(server) == expected.new


# ---- a sleep in the middle of a push ------------------------------------------------------------------
def test_a_staged_update_is_dropped_unwritten_when_the_weights_go_to_sleep(server, new_weights_path, old_weights):
    """Deterministic, on the engine thread's own terms: stage (another thread), sleep, then the copy's turn."""
    receiver = server.llm.engine.weights
    bucket = _buckets(new_weights_path)[0]
    staged = _run_off_thread(receiver.stage, [serialize(bucket.payload())], "flattened_bucket")
    assert len(staged.pairs) == len(bucket.metadata) and receiver._staged == [staged]
    before = _weights(server)
    assert server.admin.post("/sleep", params={"level": 1}).status_code == 200
    assert staged.pairs == [] and receiver._staged == []  # released before the weights went
    with pytest.raises(RuntimeError, match="went to sleep before this request's copy"):
        _on_engine_thread(server, receiver.apply_staged, staged)
    with pytest.raises(RuntimeError, match="asleep"):  # and while they sleep, nothing is opened
        _run_off_thread(receiver.stage, [serialize(bucket.payload())], "flattened_bucket")
    assert server.admin.post("/wake_up").status_code == 200
    assert all(torch.equal(before[n], p) for n, p in _weights(server).items())


def test_nothing_is_opened_while_a_sleep_or_wake_runs(server, new_weights_path):
    receiver = server.llm.engine.weights
    payload = [serialize(_buckets(new_weights_path)[0].payload())]
    with ThreadPoolExecutor(1) as pool:
        with receiver.held(drop=False):  # what a sleep or wake holds
            staging = pool.submit(receiver.stage, payload, "flattened_bucket")
            time.sleep(0.3)
            assert not staging.done()
        receiver.discard_staged(staging.result(30))
    assert receiver._staged == []


def test_a_sleep_arriving_mid_push_fails_it_cleanly(server, new_weights_path, expected, old_weights):
    """A level-2 sleep sent while a push has requests in flight: the push fails with a 409 (asleep, or dropped
    before its copy), nothing is written while the weights sleep, and the next push after the wake lands."""
    assert server.admin.post("/sleep", params={"level": 2}).status_code == 200
    assert server.admin.post("/wake_up", params={"tags": "weights"}).status_code == 200
    buckets = _buckets(new_weights_path, 8_000)
    pusher = WeightPusher(server.url, ADMIN, in_flight=2)
    sent = _counting(pusher)
    slept = threading.Event()

    def sleep_soon() -> None:
        wait_for(lambda: len(sent) >= 3, 60, "3 requests")
        assert server.admin.post("/sleep", params={"level": 2}).status_code == 200
        slept.set()

    with ThreadPoolExecutor(1) as pool:
        sleeper = pool.submit(sleep_soon)
        with pytest.raises(RuntimeError, match=r"\(409\).*(asleep|went to sleep|request \d+ of this push failed)"):
            pusher.push_buckets(buckets)
        sleeper.result(60)
    assert slept.is_set()
    assert server.llm.engine.weights._staged == []
    assert server.admin.post("/wake_up").status_code == 200
    assert not server.admin.get("/health").json()["serving"]  # discarded again: only a whole push will do
    WeightPusher(server.url, ADMIN, bucket_bytes=SMALL, in_flight=2).push(iter_checkpoint(new_weights_path))
    assert _served(server) == expected.new


def _run_off_thread(fn, *args):
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result(60)


def _on_engine_thread(server, fn, *args):
    """`fn(*args)` as a command of the server's engine thread (as the pipeline runs it)."""
    engine = server.state.engine
    return asyncio.run_coroutine_threadsafe(_submitted(engine, fn, *args), engine._loop).result(60)


async def _submitted(engine, fn, *args):
    return await engine.submit(fn, *args)


def _counting(pusher: WeightPusher) -> list:
    """The headers of each request `pusher` sends, as it sends it (its own `_post` still sends it)."""
    sent, post = [], pusher._post
    pusher._post = lambda request, headers: (sent.append(headers), post(request, headers))[1]
    return sent


# ---- a trainer process: dies mid-push; gets its memory back ------------------------------------------
TRAINER = """
    import gc, os, sys
    from torpor.engine.weights.loader import iter_checkpoint
    from torpor.rl import WeightPusher, bucket_named_tensors
    pusher = WeightPusher({url!r}, {admin!r}, bucket_bytes={bucket}, in_flight=2)
    buckets = list(bucket_named_tensors(iter_checkpoint({path!r}), {bucket}))
    if {die_after}:
        import threading, time
        sent, post = [], pusher._post
        pusher._post = lambda request, headers: (sent.append(1), post(request, headers))[1]
        threading.Thread(target=pusher.push_buckets, args=(buckets,), daemon=True).start()
        while len(sent) < {die_after}:
            time.sleep(0.001)
        os._exit(3)  # mid-push, requests in flight
    print(pusher.push(iter_checkpoint({path!r})) if {ring} else pusher.push_buckets(buckets), flush=True)
    del buckets
    gc.collect()
    mine = [f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{{os.getpid()}}_")]
    print("files left", len(mine), flush=True)
"""


def _trainer(server, path: str, die_after: int = 0, ring: bool = False) -> tuple[int, str, str]:
    code = textwrap.dedent(TRAINER.format(url=server.url, admin=ADMIN, path=path, bucket=SMALL, die_after=die_after,
                                          ring=ring))
    with tempfile.TemporaryFile("w+") as err:  # torch's shm manager would hold a stderr pipe open
        done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT}, text=True,
                              stdout=subprocess.PIPE, stderr=err, timeout=300)
        err.seek(0)
        return done.returncode, done.stdout, err.read()


@pytest.mark.slow
@pytest.mark.parametrize("ring", [False, True], ids=["own-buckets", "reused-buffers"])
def test_a_trainer_process_gets_its_memory_back(server, new_weights_path, expected, old_weights, ring):
    """Buckets of its own, or `push`'s buffers reused through the push (which the engine keeps mapped until the
    last request): either way no shared-memory file of the trainer outlives the push."""
    code, out, err = _trainer(server, new_weights_path, ring=ring)
    assert code == 0, err
    assert "files left 0" in out, out  # the engine kept no reference to the trainer's shared memory
    assert _served(server) == expected.new


@pytest.mark.slow
def test_a_trainer_that_dies_mid_push_leaves_a_level_2_engine_not_serving(server, new_weights_path, expected,
                                                                          old_weights):
    assert server.admin.post("/sleep", params={"level": 2}).status_code == 200
    assert server.admin.post("/wake_up", params={"tags": "weights"}).status_code == 200
    code, out, err = _trainer(server, new_weights_path, die_after=4)
    assert code == 3, (out, err)
    wait_for(lambda: server.llm.engine.weights._staged == [], 30, "the requests in flight to end")
    time.sleep(0.5)  # requests the server had received have answered (their trainer is gone)
    assert not server.admin.post("/wake_up", params={"tags": "kv_cache"}).json()["serving"]
    code, out, err = _trainer(server, new_weights_path)
    assert code == 0, err
    assert server.admin.get("/health").json()["serving"]
    assert _served(server) == expected.new


LEAVING_TRAINER = """
    import gc, os, threading, time
    from torpor.engine.weights.loader import iter_checkpoint
    from torpor.rl import WeightPusher, bucket_named_tensors
    pusher = WeightPusher({url!r}, {admin!r}, bucket_bytes={bucket}, in_flight=2)
    named = list(iter_checkpoint({path!r}))
    if {outcome!r} == "killed":
        sent, post = [], pusher._post
        pusher._post = lambda request, headers: (sent.append(1), post(request, headers))[1]
        threading.Thread(target=pusher.push, args=(named,), daemon=True).start()
        while len(sent) < 4:
            time.sleep(0.001)
        os._exit(3)  # mid-push, requests in flight, the engine keeping some of the buffers mapped
    try:
        if {outcome!r} == "completed":
            print(pusher.push(named))
        else:  # refused before any payload was opened: the weights are asleep
            pusher.push_buckets(list(bucket_named_tensors(named, {bucket})))
    except RuntimeError as e:
        print("refused:", e)
    gc.collect()
    mine = [f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{{os.getpid()}}_")]
    print("files left", len(mine), flush=True)
"""


def _mapped_by_this_process(pid: int) -> list[str]:
    with open("/proc/self/maps") as maps:
        return [line.split()[-1] for line in maps if f"/dev/shm/torch_{pid}_" in line]


@pytest.mark.slow
@pytest.mark.parametrize("outcome", ["completed", "refused", "killed"])
def test_after_a_push_the_engine_holds_nothing_of_the_trainer(server, new_weights_path, expected, monkeypatch,
                                                             old_weights, outcome):
    """Whatever the push's end, nothing of the trainer's stays with the engine: no connection to its torch_shm_manager
    (which then ends with the trainer: its output reaches its end, as `trainer 2>&1 | tail` needs), no mapping, no
    file in /dev/shm. Before: the engine joined every trainer's manager for good (~57 MB and an fd each); the manager
    held the trainer's output open and, with it, every file of a trainer killed mid-push (up to 4 buffers of 512 MiB
    at the defaults) until the engine exited; a refused request's buckets stayed as long as the trainer lived."""
    if outcome == "refused":
        assert server.admin.post("/sleep", params={"level": 1}).status_code == 200
    code = textwrap.dedent(LEAVING_TRAINER.format(url=server.url, admin=ADMIN, path=new_weights_path, bucket=SMALL,
                                                  outcome=outcome))
    trainer = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT}, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = trainer.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        trainer.kill()
        alive = trainer.poll() is None
        pytest.fail(f"the trainer's output never ended ({'still running' if alive else 'it exited'}): its "
                    "torch_shm_manager outlived it, held open by the engine")
    assert trainer.returncode == (3 if outcome == "killed" else 0), out
    if outcome != "killed":
        assert "files left 0" in out, out  # the trainer freed every bucket's file while alive
        assert ("refused: update_weights_from_tensor failed (409)" in out) == (outcome == "refused"), out
    wait_for(lambda: not [f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{trainer.pid}_")], 30,
             "the trainer's shared-memory files to go")
    wait_for(lambda: not _mapped_by_this_process(trainer.pid), 30, "the engine's mappings of the trainer's files to go")
    assert server.llm.engine.weights.kept() == 0
    if outcome == "refused":
        assert server.admin.post("/wake_up").status_code == 200
        assert _served(server) == expected.old
    elif outcome == "completed":
        assert _served(server) == expected.new
