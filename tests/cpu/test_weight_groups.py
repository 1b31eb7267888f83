"""Weights update groups to a trainer (torpor/engine/weights/transport.py) with real processes over gloo: formed as
SGLang forms them (an unmodified SGLang-style trainer pushes; a rank that never joins is a clear error), their
arguments checked in the API's words, a broadcast of another size than declared an error and not the engine's end
(the engine in a process of its own), and a receive on a thread of its own that ends at its deadline when the
trainer stalls."""

import contextlib
import gc
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist
from sglang_trainer import broadcast_all, trainer_group

from torpor.engine import LLM, SamplingParams
from torpor.engine.weights.loader import iter_checkpoint
from torpor.engine.weights.transport import WeightTransferError, broadcast, open_update_group, receive_tensors
from torpor.rl import WeightPusher
from torpor.rl.engine_process import EngineProcess, free_port

ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=8, block_size=4)
SERVE = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", "8", "--block-size", "4",
         "--served-model-name", "tiny"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [7, 8, 9]]
ADMIN = "admin-secret"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests")  # sglang_trainer.py, for trainer processes


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    """A `torpor serve` process: a trainer mistake that ended it would fail a test, not the test run."""
    with EngineProcess(tiny_model_path, SERVE, admin_token=ADMIN) as process:
        yield process


def _served(engine: EngineProcess) -> list[list[int]]:
    return [engine.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 12,
                                                  "temperature": 0, "ignore_eos": True,
                                                  "return_token_ids": True})["choices"][0]["token_ids"]
            for prompt in PROMPTS]


def _answers(path: str) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in LLM(path, **ENGINE).generate(PROMPTS, GREEDY)]


def _trainer(code: str, *args: str) -> subprocess.Popen:
    err = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in _finish)
    process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                               env={**os.environ, "PYTHONPATH": ROOT})
    process.err_file = err
    return process


def _finish(trainer: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    trainer.stdin.close()
    code = trainer.wait(timeout)
    out = trainer.stdout.read()
    trainer.err_file.seek(0)
    err = trainer.err_file.read()
    trainer.err_file.close()
    return code, out, err


# ---- formed as SGLang forms it ---------------------------------------------------------------------------
SGLANG_TRAINER = """
    import sys, threading, httpx
    sys.path.insert(0, {tests!r})
    from sglang_trainer import broadcast_all, trainer_group
    from torpor.engine.weights.loader import iter_checkpoint
    port = int(sys.argv[1])
    http = httpx.Client(base_url={url!r}, headers={{"Authorization": "Bearer {admin}"}}, timeout=120)
    answers = {{}}

    def post(route, body):
        answers[route] = http.post(route, json=body)

    # As slime does: the engine is asked to join, then this process forms the group (rank 0) while it joins.
    joining = threading.Thread(target=post, args=("/init_weights_update_group", {{
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": "sglang", "backend": "gloo", "timeout": 20}}))
    joining.start()
    group = trainer_group(port, 2, "sglang", timeout_s=30)
    joining.join()
    print("init", answers["/init_weights_update_group"].status_code, flush=True)
    named = list(iter_checkpoint({path!r}))
    receiving = threading.Thread(target=post, args=("/update_weights_from_distributed", {{
        "names": [n for n, _ in named], "dtypes": ["float32"] * len(named), "shapes": [list(t.shape) for _, t in named],
        "group_name": "sglang", "weight_version": "dist-1"}}))
    receiving.start()  # the broadcasts while /update_weights_from_distributed is pending
    broadcast_all(group, [t for _, t in named])
    receiving.join()
    print("update", answers["/update_weights_from_distributed"].status_code, flush=True)
    destroyed = http.post("/destroy_weights_update_group", json={{"group_name": "sglang"}})
    print("destroy", destroyed.status_code, flush=True)
"""


@pytest.mark.slow
def test_an_sglang_style_trainer_forms_the_group_and_pushes(engine, tiny_model_path, new_weights_path):
    """A trainer written as SGLang's users write it: torch's `tcp://` rendezvous as rank 0 and torch's group
    helper (what SGLang's `init_custom_process_group` calls), then `dist.broadcast` of each tensor. Before: the
    engine joined the store as a client that never counted itself in and waited for check-in keys only torpor's own
    pusher wrote; the trainer waited for its second rank ("1/2 clients joined") and the engine answered 409."""
    old = _served(engine)
    trainer = _trainer(SGLANG_TRAINER.format(url=engine.url, admin=ADMIN, path=new_weights_path, tests=TESTS),
                       str(free_port()))
    code, out, err = _finish(trainer)
    assert code == 0, err
    assert out.split() == ["init", "200", "update", "200", "destroy", "200"], (out, err, engine.output())
    assert _served(engine) == _answers(new_weights_path) != old
    assert engine.http.get("/weight_info").json() == {"weight_version": "dist-1"}  # SGLang's label, on success
    WeightPusher(engine.url, ADMIN).push(iter_checkpoint(tiny_model_path))  # the old weights, for the next tests
    engine.http.post("/update_weight_version", json={"new_version": "default"}).raise_for_status()
    assert _served(engine) == old


def _sockets_and_threads() -> tuple[int, int]:
    sockets = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return sockets, len(os.listdir("/proc/self/task"))


@pytest.mark.slow
def test_a_rank_that_never_joins_is_a_clear_error_and_leaves_nothing(tiny_model_path):
    """World of 3 (the trainer, this engine, and a rank that never comes): the engine's join fails within the
    group's timeout, names the group, and leaves no socket or thread behind; the name is free again."""
    llm = LLM(tiny_model_path, **ENGINE)
    before = _sockets_and_threads()
    port, hosted = free_port(), {}

    def host() -> None:
        try:
            trainer_group(port, 3, "partial", timeout_s=3)
        except Exception as e:  # what the trainer saw, for the assertion
            hosted["error"] = e

    trainer = threading.Thread(target=host)
    trainer.start()
    start = time.monotonic()
    with pytest.raises(WeightTransferError, match=r"'partial' did not form within 2 s: not every one of its 3 ranks"):
        llm.init_weights_update_group("127.0.0.1", port, 1, 3, "partial", "gloo", timeout=2)
    assert time.monotonic() - start < 10
    trainer.join(30)
    assert "2/3 clients joined" in str(hosted.get("error")), hosted
    gc.collect()
    deadline = time.monotonic() + 10  # no more sockets or threads than before (the trainer's thread ends too)
    while any(now > then for now, then in zip(_sockets_and_threads(), before, strict=True)):
        assert time.monotonic() < deadline, (_sockets_and_threads(), before)
        time.sleep(0.05)
    with pytest.raises(ValueError, match="no weights update group 'partial'"):
        llm.destroy_weights_update_group("partial")


@pytest.mark.parametrize("field, value, message", [
    ("master_port", True, r"master_port must be an integer in \[1, 65535\], got True"),
    ("master_port", 65536, r"master_port must be an integer in \[1, 65535\], got 65536"),
    ("world_size", 10**12, r"world_size must be an integer in \[2, 65536\] .*got 1000000000000"),
    ("world_size", True, r"world_size must be an integer in \[2, 65536\] .*got True"),
    ("rank", 2, r"rank 2 \(rank_offset \+ the engine's tensor-parallel rank; the trainer is rank 0\) must lie in"),
    ("timeout", True, r"timeout must be a number of seconds in \(0, 3600\], got True"),
    ("timeout", "5", r"timeout must be a number of seconds in \(0, 3600\], got '5'"),
    ("timeout", float("nan"), r"timeout must be a number of seconds in \(0, 3600\], got nan"),
    ("master_address", "", r"master_address must be a host name or an IP address, got ''"),
    ("master_address", "127.0.0.1 8000", r"master_address must be a host name or an IP address"),
    ("group_name", "a/b", r"group_name must be 1-128 letters"),
])
def test_group_arguments_are_refused_in_the_apis_words(field, value, message):
    """Before: a bool passed for a number (JSON's true: port 1, a timeout of 1 s), and `world_size: 10**12` reached
    TCPStore, whose answer was pybind11's list of constructor signatures."""
    args = {"master_address": "127.0.0.1", "master_port": free_port(), "rank": 1, "world_size": 2, "group_name": "g",
            "backend": "gloo", "device": torch.device("cpu"), "timeout": 1.0, field: value}
    args["timeout_s"] = args.pop("timeout")
    with pytest.raises(ValueError, match=message):
        open_update_group(**args)


# ---- sizes ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_broadcast_of_another_size_than_declared_is_an_error_not_a_crash(engine, new_weights_path):
    """float32 broadcast where bfloat16 was declared (twice the bytes): gloo ended the engine's process (SIGABRT in
    its I/O thread: every client dropped). bfloat16 where float32 was declared (half the bytes): gloo filled half of
    each tensor and said nothing. Now both are a clear error naming the tensor, the group is destroyed, and the
    engine serves its old weights."""
    named = list(iter_checkpoint(new_weights_path))
    body = {"names": [n for n, _ in named], "shapes": [list(t.shape) for _, t in named], "group_name": "mismatch"}
    before = _served(engine)
    for declared, sent, problem in (("bfloat16", torch.float32, "was longer"),
                                    ("float32", torch.bfloat16, "was shorter")):
        port, replies = free_port(), {}

        def post(route: str, json: dict, replies=replies) -> None:
            replies[route] = engine.http.post(route, json=json)

        joining = threading.Thread(target=post, args=("/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "mismatch", "backend": "gloo", "timeout": 30}))
        joining.start()
        group = trainer_group(port, 2, "mismatch", timeout_s=30)
        joining.join(60)
        assert replies["/init_weights_update_group"].status_code == 200, replies
        receiving = threading.Thread(target=post, args=("/update_weights_from_distributed",
                                                        {**body, "dtypes": [declared] * len(named)}))
        receiving.start()
        start = time.monotonic()
        with contextlib.suppress(RuntimeError):  # the engine destroys the group: the broadcasts after fail
            broadcast_all(group, [t.to(sent) for _, t in named])
        assert time.monotonic() - start < 15  # at once, not at the group's timeout (30 s)
        receiving.join(60)
        dist.destroy_process_group(group)
        assert engine.process.poll() is None, f"the engine died ({engine.process.returncode}):\n{engine.output()}"
        reply = replies["/update_weights_from_distributed"]
        assert reply.status_code == 409, reply.text
        message = reply.json()["error"]["message"]
        assert f"broadcast of {named[0][0]!r} {problem}" in message and f"declared torch.{declared}" in message, \
            message
        assert "'mismatch' failed after 0 of" in message and "the group is destroyed" in message, message
        assert "no weights update group" in engine.http.post("/destroy_weights_update_group", json={
            "group_name": "mismatch"}).text
    assert _served(engine) == before  # nothing was written


def _update_groups(world_size: int, name: str, timeout: float = 30) -> list:
    """Every rank of one group formed by `open_update_group` (rank 0 hosts), each on a thread of this process."""
    port, groups = free_port(), [None] * world_size

    def join(rank: int) -> None:
        groups[rank] = open_update_group("127.0.0.1", port, rank, world_size, name, "gloo", torch.device("cpu"),
                                         timeout)

    joining = [threading.Thread(target=join, args=(rank,)) for rank in range(world_size)]
    for t in joining:
        t.start()
    for t in joining:
        t.join(timeout + 10)
    assert all(groups), "the group did not form"
    return groups


@pytest.mark.parametrize("world_size", [3, 4])
def test_receives_fit_any_dtype_on_every_rank_also_where_gloo_forwards(world_size):
    """gloo's broadcast is a tree: from 4 ranks on, an engine rank forwards what it received to another, its whole
    buffer. The receive buffers stay alike on every rank, so a correct push arrives whole everywhere and a push in
    another dtype (float32 for bfloat16: twice the bytes) is the same clear error on every rank, not an abort."""
    sent = [torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.full((5,), 0.5, dtype=torch.float32)]
    for declared, failing in ((torch.float32, False), (torch.bfloat16, True)):
        groups = _update_groups(world_size, f"tree{world_size}")
        specs = [(f"t{i}", declared, tuple(t.shape)) for i, t in enumerate(sent)]
        results: list = [None] * world_size

        def receive(rank: int, specs=specs, results=results, groups=groups) -> None:
            try:
                results[rank] = receive_tensors(groups[rank], specs)
            except WeightTransferError as e:
                results[rank] = e

        receiving = [threading.Thread(target=receive, args=(rank,)) for rank in range(1, world_size)]
        for t in receiving:
            t.start()
        with contextlib.suppress(RuntimeError):  # failing: the engine ranks destroy the group
            for tensor in sent:
                broadcast(groups[0], tensor.clone())
        for t in receiving:
            t.join(30)
        for rank in range(1, world_size):
            if failing:
                assert isinstance(results[rank], WeightTransferError), (rank, results[rank])
                assert "broadcast of 't0' was longer than its declared torch.bfloat16 [3, 4]" in str(results[rank])
            else:
                assert [n for n, _ in results[rank]] == ["t0", "t1"], (rank, results[rank])
                assert all(torch.equal(got, want) for (_, got), want in zip(results[rank], sent, strict=True))


# ---- a trainer that stalls -----------------------------------------------------------------------------
STALLING_TRAINER = """
    import sys, torch
    sys.path.insert(0, sys.argv[3])
    from sglang_trainer import broadcast_all, trainer_group
    group = trainer_group(int(sys.argv[1]), 2, "stall", timeout_s=60)
    broadcast_all(group, [torch.full((4,), float(i)) for i in range(int(sys.argv[2]))])
    print("sent", flush=True)
    sys.stdin.readline()  # and then nothing more
"""


@pytest.mark.slow
@pytest.mark.parametrize("sent", [0, 1])
def test_a_receive_on_its_own_thread_ends_at_its_deadline_when_the_trainer_stalls(sent):
    """A trainer that joined and then stops broadcasting: the receive (on a thread of its own, as the engine runs it
    off its step) ends at its deadline, not at the group's timeout (60 s), with an error saying how many tensors
    arrived; the group is destroyed, and its stuck broadcast ended (the thread is gone). gloo's group cannot be
    aborted out of a waiting broadcast (its `abort()` leaves the wait, and the process then ends at its exit): each
    broadcast waits until the deadline at most."""
    port = free_port()
    trainer = _trainer(STALLING_TRAINER, str(port), str(sent), TESTS)
    try:
        group = open_update_group("127.0.0.1", port, 1, 2, "stall", "gloo", torch.device("cpu"), 60)
        specs = [(f"t{i}", torch.float32, (4,)) for i in range(3)]
        outcome = {}

        def receive() -> None:
            try:
                outcome["tensors"] = receive_tensors(group, specs, deadline=time.monotonic() + 1.5)
            except WeightTransferError as e:
                outcome["error"] = e

        start = time.monotonic()
        receiving = threading.Thread(target=receive)
        receiving.start()
        receiving.join(30)
        waited = time.monotonic() - start
        assert not receiving.is_alive(), "the receive still waits"
        assert 1.4 < waited < 10, waited
        assert f"'stall' failed after {sent} of 3 tensors arrived" in str(outcome.get("error")), outcome
        assert "the deadline passed: the trainer sent nothing more" in str(outcome["error"])
        assert group.destroyed and group.group is None
        assert trainer.stdout.readline().strip() == "sent"
    finally:
        _finish(trainer)
