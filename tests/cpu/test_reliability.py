"""Nothing lost, nothing hangs, never a mix — against a real server (uvicorn in a thread, the tiny fp32 model on
CPU) and real trainer processes:

- a push that stops after k of n requests, or is refused half-way, is never served as a mix of old and new weights:
  with a current host copy (a level-1 sleep and wake before it: the RL order) the old weights come back and serve
  bit for bit; without, the engine does not serve until a complete update, and says which tensors are missing;
- a trainer that joined a group and never broadcasts does not stall inference: requests are answered on the old
  weights while the update waits, and the update gives up after its timeout;
- a dead tensor-parallel worker makes /health say so (503, with the reason);
- `LLM.close()` on CPU really closes; two engines in one process (one rank and two ranks) both answer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
import torch
from server_thread import ServerThread, wait_for

from torpor.engine import LLM, SamplingParams
from torpor.engine.weights.loader import iter_checkpoint
from torpor.rl import WeightPusher, bucket_named_tensors, serialize
from torpor.rl.engine_process import free_port
from torpor.server import ServerConfig, build_app
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
    app = build_app(llm.engine, ServerConfig("tiny", admin_token=ADMIN, max_body_bytes=1 << 20,
                                             push_idle_timeout_s=IDLE_S))
    with ServerThread(app) as url:
        admin = httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {ADMIN}"})
        yield SimpleNamespace(url=url, llm=llm, admin=admin)


@pytest.fixture(scope="module")
def expected(tiny_model_path, new_weights_path) -> SimpleNamespace:
    return SimpleNamespace(old=_answers(LLM(tiny_model_path, **ENGINE)), new=_answers(LLM(new_weights_path, **ENGINE)))


@pytest.fixture
def old_weights(server, tiny_model_path):
    """Every test starts and ends with the old weights, awake and serving."""
    server.admin.post("/wake_up")
    WeightPusher(server.url, ADMIN, in_flight=1).push(iter_checkpoint(tiny_model_path))
    yield
    server.admin.post("/wake_up")
    WeightPusher(server.url, ADMIN, in_flight=1).push(iter_checkpoint(tiny_model_path))
    assert server.admin.get("/health").json()["serving"]


def _answers(llm) -> list:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _served(server, timeout: float = 60) -> list:
    out = []
    for prompt in PROMPTS:
        r = server.admin.post("/v1/completions", timeout=timeout, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["token_ids"])
    return out


def _post(server, bucket, push_id: str, index: int, last: bool = False) -> httpx.Response:
    headers = {"X-Torpor-Push-Id": push_id, "X-Torpor-Push-Index": str(index)}
    if last:
        headers["X-Torpor-Push-Last"] = "1"
    return server.admin.post("/update_weights_from_tensor", headers=headers, json={
        "serialized_named_tensors": [serialize(bucket.payload())], "load_format": "flattened_bucket"})


def _buckets(path: str) -> list:
    return list(bucket_named_tensors(iter_checkpoint(path), SMALL))


def _health(server) -> dict:
    return server.admin.get("/health").json()


# ---- a push is one update ------------------------------------------------------------------------------
@pytest.mark.parametrize("clean", [True, False], ids=["host-copy-current", "no-host-copy"])
def test_a_push_that_stops_midway_is_never_served_as_a_mix(server, new_weights_path, expected, old_weights, clean):
    if clean:  # the RL order at level 1: sleep, wake the weights (their host copy is current), push
        assert server.admin.post("/sleep", params={"level": 1}).status_code == 200
        assert server.admin.post("/wake_up", params={"tags": "weights"}).status_code == 200
    buckets = _buckets(new_weights_path)
    for i, bucket in enumerate(buckets[:3]):  # 3 of n, then the trainer goes quiet
        assert _post(server, bucket, f"stops-{clean}", i).status_code == 200
    assert not _health(server)["serving"]  # nothing runs while the push is in progress
    server.admin.post("/wake_up")
    wait_for(lambda: server.llm.engine.lifecycle.updating is None, 10 * IDLE_S, "the push to be given up")
    if clean:
        assert _health(server)["serving"] and _served(server) == expected.old  # the old weights, bit for bit
    else:
        state = server.llm.engine.state()
        assert not state.serving and not state.weights_valid
        written = {name for bucket in buckets[:3] for name, *_ in bucket.metadata}
        assert set(state.missing_weights) and not set(state.missing_weights) & written
        assert "tensors not written since" in state.not_serving_reason()
        r = server.admin.post("/v1/completions", headers={"X-Asleep-Timeout": "0.2"}, json={
            "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 2})
        assert r.status_code == 503, r.text
    WeightPusher(server.url, ADMIN, bucket_bytes=SMALL, in_flight=2).push(iter_checkpoint(new_weights_path))
    assert _served(server) == expected.new  # a complete push lands whole


def test_a_push_refused_half_way_puts_the_old_weights_back_at_once(server, new_weights_path, expected, old_weights):
    assert server.admin.post("/sleep", params={"level": 1}).status_code == 200
    assert server.admin.post("/wake_up").status_code == 200  # the host copy is current
    buckets = _buckets(new_weights_path)
    buckets[3].flattened[:64].view(torch.float32)[0] = float("nan")
    pusher = WeightPusher(server.url, ADMIN, in_flight=2)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"failed \(400\).*non-finite"):
        pusher.push_buckets(buckets)
    wait_for(lambda: server.llm.engine.lifecycle.updating is None, IDLE_S / 2, "the failed push to end")
    assert time.monotonic() - start < IDLE_S  # at once, not at the idle timeout
    assert _health(server)["serving"] and _served(server) == expected.old


def test_an_in_process_update_that_fails_midway_is_undone(tiny_model_path, new_weights_path, expected):
    llm = LLM(tiny_model_path, **ENGINE)
    llm.sleep(1)
    llm.wake_up()
    new = list(iter_checkpoint(new_weights_path))

    def stream():
        yield from new[:5]
        raise OSError("the trainer went away")

    with pytest.raises(Exception, match="the trainer went away"):
        llm.update_weights(stream())
    assert llm.state.serving and _answers(llm) == expected.old


# ---- a stalled trainer does not stall inference ----------------------------------------------------------
STALLED_TRAINER = """
    import sys, time
    from torpor.rl import DistributedPusher
    pusher = DistributedPusher({url!r}, {admin!r}, "127.0.0.1", int(sys.argv[1]), "cpu", timeout=30)
    print("joined", flush=True)
    time.sleep(120)  # never broadcasts
"""


def test_a_trainer_that_never_broadcasts_does_not_stall_inference(server, tiny_model_path, expected, old_weights):
    code = textwrap.dedent(STALLED_TRAINER.format(url=server.url, admin=ADMIN))
    trainer = subprocess.Popen([sys.executable, "-c", code, str(free_port())], text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        assert trainer.stdout.readline().strip() == "joined"
        named = list(iter_checkpoint(tiny_model_path))
        body = {"names": [n for n, _ in named], "dtypes": ["float32"] * len(named),
                "shapes": [list(t.shape) for _, t in named], "timeout": 3.0}
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(server.admin.post, "/update_weights_from_distributed", json=body)
            time.sleep(0.3)
            start = time.monotonic()
            assert _served(server) == expected.old  # answered on the old weights while the update waits
            assert time.monotonic() - start < 2.5 and not pending.done()
            answer = pending.result(30)
        assert answer.status_code == 409 and "the deadline passed" in answer.text, answer.text
        assert _health(server)["serving"] and _served(server) == expected.old
    finally:
        trainer.kill()
        trainer.wait(30)


# ---- a dead worker is not hidden; close closes; two engines in one process ---------------------------------
def test_a_dead_tensor_parallel_worker_makes_health_unhealthy(tiny_model_path):
    llm = LLM(tiny_model_path, tensor_parallel_size=2, **ENGINE)
    app = build_app(llm.engine, ServerConfig("tiny", admin_token=ADMIN))
    try:
        with ServerThread(app) as url:
            assert httpx.get(f"{url}/health").status_code == 200
            worker = llm.engine.executor.processes[0]
            worker.kill()
            wait_for(lambda: httpx.get(f"{url}/health").status_code == 503, 10, "/health to say unhealthy")
            body = httpx.get(f"{url}/health").json()
            assert body["status"] == "unhealthy" and f"pid {worker.pid}" in body["reason"], body
            r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2},
                           headers={"X-Asleep-Timeout": "0.5"})
            assert r.status_code == 503, r.text
    finally:
        llm.close()


def test_close_on_cpu_closes(tiny_model_path):
    llm = LLM(tiny_model_path, **ENGINE)
    assert _answers(llm)
    llm.close()
    with pytest.raises(RuntimeError, match="it was closed"):
        llm.generate(PROMPTS, GREEDY)


def test_close_gives_the_memory_back_while_the_llm_is_still_referenced(tiny_model_path):
    """An RL driver that closes one engine and starts another in the same process must not hold both models: the
    weights, the KV cache and the runtime state go at `close`, not when the LLM object is collected."""
    llm = LLM(tiny_model_path, **ENGINE)
    runner = llm.engine.executor.driver.runner
    held = [weakref.ref(t) for t in (runner.model.model.embed_tokens.weight, runner.model.model.norm.weight,
                                     runner.buffers.tokens, runner.kv_cache)]
    del runner
    llm.close()
    assert [ref() is None for ref in held] == [True] * len(held)
    for call in (lambda: llm.sleep(1), llm.wake_up, lambda: llm.reload_weights()):
        with pytest.raises(RuntimeError, match="it was closed"):
            call()
    llm.close()  # a second close does nothing


def test_two_engines_in_one_process_each_answer(tiny_model_path, expected):
    """One rank and two ranks in one process: each engine owns its own process group, so neither joins the other's
    collectives (the one-rank engine's all-reduce once joined the two-rank group's and waited forever)."""
    one = LLM(tiny_model_path, **ENGINE)
    two = LLM(tiny_model_path, tensor_parallel_size=2, **ENGINE)
    try:
        assert _answers(two) == expected.old
        assert _answers(one) == expected.old
        two.sleep(1)
        two.wake_up()
        assert _answers(one) == _answers(two) == expected.old
    finally:
        two.close()
        one.close()
