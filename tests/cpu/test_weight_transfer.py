"""Weights pushed by a trainer in another process (torpor/engine/weights/, torpor/rl): shared-memory
payloads (SGLang's `update_weights_from_tensor`) in process and over HTTP, flattened buckets, the restricted
unpickler against malicious pickles, checks before any write, level-2 pushes in several buckets, and the
gloo process-group path (`init_weights_update_group` / `update_weights_from_distributed`) across real
processes, including a group that never forms and a trainer that dies mid-update (how the group forms, its
arguments, sizes and deadlines: test_weight_groups.py)."""

import base64
import io
import os
import pickle
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace

import httpx
import pytest
import torch
from server_thread import ServerThread

from torpor.engine import LLM, SamplingParams
from torpor.engine.executor import RankError
from torpor.engine.weights.index import CheckpointError
from torpor.engine.weights.loader import iter_checkpoint
from torpor.engine.weights.payload import RefusedPickle, RestrictedUnpickler, named_tensors_of, unpickle_payload
from torpor.engine.weights.transport import await_work
from torpor.rl import WeightPusher, bucket_named_tensors, serialize
from torpor.rl.engine_process import free_port
from torpor.server import ServerConfig, build_app

ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=8, block_size=4)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
PROMPTS = [[1, 2, 3, 4], [7, 8, 9]]
ADMIN = "admin-secret"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests")  # sglang_trainer.py, for trainer processes


@pytest.fixture(scope="module")
def expected(tiny_model_path, new_weights_path) -> SimpleNamespace:
    """Greedy outputs (tokens, logprobs) of the old weights and of the new ones."""
    old = LLM(tiny_model_path, **ENGINE)
    new = LLM(new_weights_path, **ENGINE)
    result = SimpleNamespace(old=_answers(old), new=_answers(new))
    assert result.old != result.new  # the push is visible
    return result


def _answers(llm) -> list:
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY)]
    return [(c.token_ids, [round(lp[t].logprob, 5) for lp, t in zip(c.logprobs, c.token_ids, strict=True)])
            for c in outputs]


def _run_trainer(code: str, *args: str) -> subprocess.Popen:
    """A trainer process. Its stderr goes to a file: torch's shared-memory manager (a daemon the trainer
    starts) inherits the trainer's pipes and would hold them open after the trainer exits."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    err = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed with the trainer, in _finish)
    trainer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
    trainer.err_file = err
    return trainer


def _finish(trainer: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    """Close its stdin, wait for it to exit; (exit code, stdout lines until then, stderr)."""
    trainer.stdin.close()
    code = trainer.wait(timeout)
    out = _read_available(trainer.stdout)
    trainer.err_file.seek(0)
    err = trainer.err_file.read()
    trainer.err_file.close()
    return code, out, err


def _read_available(stream) -> str:
    os.set_blocking(stream.fileno(), False)
    try:
        return stream.read() or ""
    except (BlockingIOError, TypeError):
        return ""


# ---- the restricted unpickler -----------------------------------------------------------------------
class _Evil:
    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.mark.parametrize("make", [
    lambda marker: _Evil(os.system, f"touch {marker}"),
    lambda marker: _Evil(eval, f"open({str(marker)!r}, 'w')"),
    lambda marker: _Evil(subprocess.Popen, ["touch", str(marker)]),
    lambda marker: _Evil(torch.load, str(marker)),
])
def test_malicious_pickles_are_refused_and_never_run(tmp_path, make):
    marker = tmp_path / "pwned"
    payload = base64.b64encode(pickle.dumps([("model.norm.weight", make(marker))])).decode()
    with pytest.raises(RefusedPickle, match="refused to unpickle"):
        unpickle_payload(payload, max_bytes=1 << 20)
    assert not marker.exists()


def test_allowed_classes_cannot_be_called_and_object_opcodes_are_refused():
    class CallsTensor:
        def __reduce__(self):
            return torch.Tensor, (1 << 40,)  # would allocate 4 TiB if torch.Tensor were callable

    with pytest.raises(RefusedPickle):
        RestrictedUnpickler(pickle.dumps(CallsTensor()), 1 << 20).load()
    with pytest.raises(RefusedPickle, match="object-building opcode"):
        # OrderedDict() then BUILD with a state dict (BUILD can set attributes / call __setstate__)
        RestrictedUnpickler(b"\x80\x02ccollections\nOrderedDict\n)R}b.", 1 << 20).load()


def test_sglang_bucket_metadata_dataclass_is_accepted(monkeypatch):
    """SGLang's trainers pickle `FlattenedTensorMetadata` dataclass instances (NEWOBJ + BUILD)."""
    import dataclasses
    import types

    module = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")
    fields = [("name", str), ("shape", torch.Size), ("dtype", torch.dtype), ("start_idx", int), ("end_idx", int),
              ("numel", int)]
    meta_cls = dataclasses.make_dataclass("FlattenedTensorMetadata", fields)
    meta_cls.__module__ = module.__name__
    module.FlattenedTensorMetadata = meta_cls
    for parent in ("sglang", "sglang.srt", "sglang.srt.weight_sync"):
        monkeypatch.setitem(sys.modules, parent, sys.modules.get(parent) or types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    a, b = torch.randn(2, 3), torch.randn(4)
    bucket = {"flattened_tensor": torch.cat([a.flatten(), b]),
              "metadata": [meta_cls("a", a.shape, a.dtype, 0, 6, 6), meta_cls("b", b.shape, b.dtype, 6, 10, 4)]}
    pairs = named_tensors_of(unpickle_payload(serialize(bucket), 1 << 20), "flattened_bucket")
    assert [n for n, _ in pairs] == ["a", "b"] and torch.equal(pairs[0][1], a) and torch.equal(pairs[1][1], b)
    forged = pickle.dumps(meta_cls("a", a.shape, a.dtype, 0, 6, 6)).replace(b"numel", b"evil_")
    with pytest.raises(RefusedPickle, match="object-building opcode"):
        RestrictedUnpickler(forged, 1 << 20).load()


def test_shared_memory_names_and_sizes_are_checked():
    from torch.multiprocessing import reductions

    class FakeStorage:
        def __init__(self, manager, handle, size) -> None:
            self.args = (torch.storage.UntypedStorage, manager, handle, size)

        def __reduce__(self):
            return reductions.rebuild_storage_filename, self.args

    torch.multiprocessing.set_sharing_strategy("file_system")
    real = torch.zeros(4).untyped_storage()
    manager, handle, _ = real._share_filename_cpu_()
    for args, match in [((manager, b"/../../etc/passwd", 4), "not a torch shared-memory file"),
                        ((b"/tmp/x.sock", handle, 4), "torch_shm_manager"),
                        ((manager, handle, 1 << 30), r"holds 16 bytes, the payload claims 1073741824")]:
        with pytest.raises(ValueError, match=match):
            RestrictedUnpickler(pickle.dumps(FakeStorage(*args)), 1 << 40).load()


SHRINKING = """
    import os, torch
    from torpor.engine.weights.payload import unpickle_payload
    from torpor.rl import serialize
    t = torch.ones(1 << 18)  # 1 MiB in one shared-memory file
    kept = unpickle_payload(serialize([("x", t)]), 1 << 30)  # mapped, and kept (a push keeps its buffers mapped)
    os.truncate("/dev/shm" + t.untyped_storage()._share_filename_cpu_()[1].decode(), 64 + 4096)
    for _ in range(2):  # the mapping kept, then a new one
        try:
            unpickle_payload(serialize([("x", t)]), 1 << 30)[0][1].sum()
            print("read")
        except ValueError as e:
            print("refused:", e)
        kept = None
"""


@pytest.mark.slow
def test_a_shared_memory_file_that_shrank_is_refused_not_a_crash():
    """Reading a mapping past its file's end is SIGBUS: the engine gone. A file shorter than the payload claims is
    refused whether this process still has it mapped (a push keeps its buffers mapped) or maps it anew."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(SHRINKING)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert result.returncode == 0, f"the engine died ({result.returncode}): {result.stderr[-1000:]}"
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all(re.search(r"refused: .* holds 4096 bytes( now)?, the payload claims 1048576", line)
                                   for line in lines), result.stdout


def test_flattened_bucket_round_trip_and_bad_metadata():
    tensors = [("a", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16)), ("c", torch.randn(2, 2))]
    buckets = list(bucket_named_tensors(tensors, bucket_bytes=60))
    assert [len(b.metadata) for b in buckets] == [2, 1]  # a + b: 48 + 10 bytes; c: 16 more would pass 60
    assert buckets[0].metadata[1][3] == 48 and buckets[0].nbytes == 64  # b starts aligned; padded to 16 bytes
    decoded = [p for b in buckets for p in named_tensors_of(unpickle_payload(serialize(b.payload()), 1 << 20),
                                                            "flattened_bucket")]
    assert [n for n, _ in decoded] == ["a", "b", "c"]
    for (_, want), (_, got) in zip(tensors, decoded, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    (odd_then_fp32,) = bucket_named_tensors([tensors[1], tensors[2]])  # fp32 after 10 bytes of bf16: aligned
    assert torch.equal(named_tensors_of(odd_then_fp32.payload(), "flattened_bucket")[1][1], tensors[2][1])
    bad = {"flattened_tensor": torch.zeros(8, dtype=torch.uint8), "metadata": [("a", [3], torch.float32, 0, 8)]}
    with pytest.raises(ValueError, match="needs 12"):
        named_tensors_of(bad, "flattened_bucket")
    with pytest.raises(ValueError, match="outside the bucket"):
        named_tensors_of({**bad, "metadata": [("a", [3], torch.float32, 4, 16)]}, "flattened_bucket")


# ---- in process, from another process's shared memory ------------------------------------------------
TRAINER_PAYLOAD = """
    import sys, torch
    from torpor.engine.weights.loader import iter_checkpoint
    from torpor.rl import bucket_named_tensors, serialize
    named = list(iter_checkpoint({path!r}))
    print(serialize([b.payload() for b in bucket_named_tensors(named, 1 << 20)][0] if {bucketed} else named),
          flush=True)
    sys.stdin.readline()  # keep the shared memory until the engine has copied it
"""


@pytest.mark.slow
@pytest.mark.parametrize("bucketed", [False, True])
def test_in_process_llm_takes_another_process_shared_memory(tiny_model_path, new_weights_path, expected, bucketed):
    llm = LLM(tiny_model_path, **ENGINE)
    trainer = _run_trainer(TRAINER_PAYLOAD.format(path=new_weights_path, bucketed=bucketed))
    try:
        payload = trainer.stdout.readline().strip()
        assert payload, _finish(trainer)
        load_format = "flattened_bucket" if bucketed else None  # the tiny model fits one 1 MiB bucket
        assert llm.update_weights_from_tensor(serialized_named_tensors=[payload], load_format=load_format) > 0
    finally:
        trainer.stdin.write("done\n")
        _finish(trainer)
    assert _answers(llm) == expected.new


def test_checks_before_any_write_and_weights_asleep(tiny_model_path, new_weights_path, expected):
    llm = LLM(tiny_model_path, **ENGINE)
    named = list(iter_checkpoint(new_weights_path))
    bad_shape = [*named[:-1], (named[-1][0], named[-1][1][:1])]
    with pytest.raises(ValueError, match=r"nothing was written.*has shape"):
        llm.update_weights_from_tensor(bad_shape)
    with pytest.raises(ValueError, match=r"unknown tensor 'model\.layers\.99\.mlp\.up_proj\.weight'"):
        llm.update_weights_from_tensor([*named, ("model.layers.99.mlp.up_proj.weight", named[0][1])])
    with pytest.raises(ValueError, match=r"dtype torch\.int64"):
        llm.update_weights_from_tensor([(named[0][0], named[0][1].long())])
    assert _answers(llm) == expected.old  # every refused update left the old weights serving
    llm.sleep(1)
    with pytest.raises(RuntimeError, match="the weights are asleep"):
        llm.update_weights_from_tensor(named)
    llm.wake_up()
    assert _answers(llm) == expected.old


def test_level_2_push_in_buckets_serves_once_complete(tiny_model_path, new_weights_path, expected):
    llm = LLM(tiny_model_path, **ENGINE)
    llm.sleep(2)
    llm.wake_up(["weights"])
    buckets = list(bucket_named_tensors(iter_checkpoint(new_weights_path), bucket_bytes=200_000))
    assert len(buckets) > 1
    for i, bucket in enumerate(buckets):
        assert llm.engine.lifecycle.weights_discarded, f"valid before bucket {i} of {len(buckets)}"
        llm.update_weights_from_tensor(bucket.payload(), load_format="flattened_bucket")
    assert not llm.engine.lifecycle.weights_discarded
    llm.wake_up(["kv_cache"])
    assert _answers(llm) == expected.new


def _half_pushed(tiny_model_path, new_weights_path):
    """An engine woken from a level-2 sleep that got the first half of the new weights: (llm, first, second)."""
    llm = LLM(tiny_model_path, **ENGINE)
    named = list(iter_checkpoint(new_weights_path))
    first, second = named[: len(named) // 2], named[len(named) // 2:]
    llm.sleep(2)
    llm.wake_up(["weights"])
    llm.update_weights_from_tensor(first)
    return llm, first, second


def _second_half_then_whole(llm, first, second, expected, why: str) -> None:
    """The second half alone must not make the weights valid (`why` if it does); the first half after it does,
    and the engine answers with the new weights."""
    llm.update_weights_from_tensor(second)
    assert llm.engine.lifecycle.weights_discarded, why
    llm.update_weights_from_tensor(first)
    assert not llm.engine.lifecycle.weights_discarded
    llm.wake_up()
    assert _answers(llm) == expected.new


def test_a_second_level_2_sleep_mid_push_starts_the_count_over(tiny_model_path, new_weights_path, expected):
    llm, first, second = _half_pushed(tiny_model_path, new_weights_path)
    llm.wake_up()
    assert llm.engine.lifecycle.weights_discarded  # half a model: not serving
    llm.sleep(2)  # discards the first half again
    llm.wake_up(["weights"])
    _second_half_then_whole(llm, first, second, expected, "the first half was counted although discarded again")


def test_a_count_left_by_a_reload_does_not_make_a_later_mix_whole(tiny_model_path, new_weights_path, expected):
    """A push counting down after a level-2 sleep, then a reload (valid again), then a failed update's mix: the
    old count must not let half a model make the mix whole (the count starts over whenever the weights become
    discarded)."""
    llm, first, second = _half_pushed(tiny_model_path, new_weights_path)  # the second half still missing
    llm.reload_weights()  # valid again, from the checkpoint
    assert not llm.engine.lifecycle.weights_discarded

    def failing():
        yield first[0]
        yield first[1][0], torch.ones(3, 3)  # a wrong shape after one tensor was written: a mix

    with pytest.raises(CheckpointError, match="failed after writing 1 tensors"):
        llm.update_weights(failing())
    _second_half_then_whole(llm, first, second, expected, "the count from before the reload made the mix whole")


# ---- over HTTP -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_path):
    llm = LLM(tiny_model_path, **ENGINE)
    config = ServerConfig("tiny", admin_token=ADMIN, max_body_bytes=1 << 20)
    with ServerThread(build_app(llm.engine, config)) as url:
        yield SimpleNamespace(url=url, llm=llm, admin=httpx.Client(base_url=url, timeout=120,
                                                                   headers={"Authorization": f"Bearer {ADMIN}"}))


def _served(server) -> list:
    out = []
    for prompt in PROMPTS:
        r = server.admin.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 12,
                                                      "temperature": 0, "ignore_eos": True, "logprobs": 0,
                                                      "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        out.append((choice["token_ids"], [round(x, 5) for x in choice["logprobs"]["token_logprobs"]]))
    return out


TRAINER_HTTP = """
    from torpor.engine.weights.loader import iter_checkpoint
    from torpor.rl import WeightPusher
    pusher = WeightPusher({url!r}, {admin!r}, bucket_bytes=200_000, buckets_per_request=2)  # 4 buckets, 2 requests
    print(pusher.push(iter_checkpoint({path!r})), flush=True)
"""


@pytest.mark.slow
def test_http_rl_cycle_from_a_trainer_process(server, tiny_model_path, new_weights_path, expected):
    old = _served(server)
    assert old == expected.old
    r = server.admin.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["AAAA"]})
    assert r.status_code == 400 and "pickle" in r.json()["error"]["message"]
    evil = base64.b64encode(pickle.dumps([("x", _Evil(os.system, "true"))])).decode()
    r = server.admin.post("/update_weights_from_tensor", json={"serialized_named_tensors": [evil]})
    assert r.status_code == 400 and "refused to unpickle posix.system" in r.json()["error"]["message"]
    assert server.admin.post("/sleep", params={"level": 2}).status_code == 200
    r = server.admin.post("/update_weights_from_tensor", json={"serialized_named_tensors": [evil]})
    assert r.status_code == 409 and "asleep" in r.json()["error"]["message"]  # before any unpickling
    assert server.admin.post("/wake_up", params={"tags": "weights"}).status_code == 200
    trainer = _run_trainer(TRAINER_HTTP.format(url=server.url, admin=ADMIN, path=new_weights_path))
    code, out, err = _finish(trainer)
    assert code == 0, err
    assert "GB/s" in out
    assert server.admin.post("/wake_up", params={"tags": "kv_cache"}).json()["serving"]
    assert _served(server) == expected.new
    pusher = WeightPusher(server.url, ADMIN)  # back to the old weights, for the next tests
    report = pusher.push(iter_checkpoint(tiny_model_path))
    assert report.requests == report.buckets >= 1  # the engine's answers carry its time per phase
    assert {"decode", "check", "plan", "finite", "copy", "sync", "release", "total"} <= set(report.engine_phases)
    rpc = server.admin.post("/collective_rpc", json={"method": "update_weights_from_tensor", "kwargs": {
        "serialized_named_tensors": [serialize(list(iter_checkpoint(tiny_model_path))[:2])]}})
    assert rpc.status_code == 200 and rpc.json()["results"][0]["num_tensors"] == 2
    assert _served(server) == old


HOLDING_TRAINER = """
    import gc, os, sys, torch
    from torpor.engine.weights.loader import iter_checkpoint
    from torpor.rl import bucket_named_tensors, serialize
    torch.multiprocessing.set_sharing_strategy("file_system")
    bucket = next(bucket_named_tensors(iter_checkpoint(sys.argv[1]), 1 << 20))  # the tiny model: one bucket
    bucket.flattened.share_memory_()
    manager, handle, size = bucket.flattened.untyped_storage()._share_filename_cpu_()
    print(manager.decode(), handle.decode(), size, flush=True)  # named, never pickled: no reference added
    for line in sys.stdin:
        if line.strip() == "pickle":
            print(serialize(bucket.payload()), flush=True)
        else:
            del bucket
            gc.collect()
            print(os.path.exists("/dev/shm" + handle.decode()), flush=True)
            break
"""


@pytest.mark.slow
def test_a_pickle_replayed_or_forged_never_takes_the_trainers_own_reference(server, tiny_model_path, new_weights_path):
    """A shared-memory file's count is the trainer's own mapping plus one per pickle in transit. Before: the engine
    took one back per payload it opened, whether a pickle had added it or not: a payload naming another process's
    file (no pickle of it) made the engine unlink it, and a request sent twice (a client timeout, then a resend)
    unlinked the trainer's live bucket, whose next push failed with "does not exist". Now a payload takes back a
    reference only while more than the owner's is left: a replay is harmless, the trainer's file lives while it
    maps it and goes when it drops it."""
    from torch.multiprocessing import reductions

    from torpor.engine.weights import shm

    trainer = _run_trainer(HOLDING_TRAINER, new_weights_path)
    try:
        manager, handle, size = trainer.stdout.readline().split()
        assert handle, _finish(trainer)

        class Named:  # the trainer's file, named by someone else: no reference was added for the engine
            def __reduce__(self):
                return reductions.rebuild_storage_filename, (torch.storage.UntypedStorage, manager, handle, int(size))

        forged = base64.b64encode(ForkingPickler.dumps(Named())).decode()
        r = server.admin.post("/update_weights_from_tensor", json={"serialized_named_tensors": [forged]})
        assert r.status_code == 400 and "list of (name, tensor) pairs" in r.text, r.text  # opened, then refused
        assert shm.count_of(handle) == 1  # the trainer's own, untouched
        trainer.stdin.write("pickle\n")
        trainer.stdin.flush()
        body = {"serialized_named_tensors": [trainer.stdout.readline().strip()], "load_format": "flattened_bucket"}
        for attempt in range(2):  # the same request twice: a client that resent it after a timeout
            r = server.admin.post("/update_weights_from_tensor", json=body)
            assert r.status_code == 200, (attempt, r.text)
            assert shm.count_of(handle) == 1
        trainer.stdin.write("pickle\n")  # the trainer's next push of the same buffer
        trainer.stdin.flush()
        body["serialized_named_tensors"] = [trainer.stdout.readline().strip()]
        r = server.admin.post("/update_weights_from_tensor", json=body)
        assert r.status_code == 200, r.text
        trainer.stdin.write("drop\n")
        trainer.stdin.flush()
        assert trainer.stdout.readline().strip() == "False"  # the count was right: its file went with its buffer
    finally:
        _finish(trainer)
    WeightPusher(server.url, ADMIN).push(iter_checkpoint(tiny_model_path))  # the old weights, for the next tests


# ---- the process-group path (gloo) ------------------------------------------------------------------
TRAINER_GROUP = """
    import os, socket, sys
    from torpor.engine.weights.loader import iter_checkpoint
    from torpor.rl import DistributedPusher
    port = int(sys.argv[1])
    pusher = DistributedPusher({url!r}, {admin!r}, "127.0.0.1", port, "cpu", timeout=30)
    named = list(iter_checkpoint({path!r}))
    if {die_midway}:
        import httpx, threading
        from torpor.engine.weights.transport import broadcast
        body = {{"names": [n for n, _ in named], "dtypes": ["float32"] * len(named),
                "shapes": [list(t.shape) for _, t in named], "group_name": "weight_update_group"}}
        threading.Thread(target=pusher.http.post, args=("/update_weights_from_distributed",),
                         kwargs={{"json": body}}, daemon=True).start()
        for _, t in named[:3]:
            broadcast(pusher.group, t)
        print("dying", flush=True)
        os._exit(3)
    print(pusher.push(named), flush=True)
    pusher.close()
"""


@pytest.mark.slow
def test_process_group_push_and_failures(server, tiny_model_path, new_weights_path, expected):
    old = expected.old
    # a group that never forms: nobody hosts the store
    r = server.admin.post("/init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
        "group_name": "nobody", "backend": "gloo", "timeout": 1.0})
    assert r.status_code == 409 and "nobody" in r.json()["error"]["message"], r.text
    assert _served(server) == old
    # a trainer that dies after 3 of its tensors
    trainer = _run_trainer(TRAINER_GROUP.format(url=server.url, admin=ADMIN, path=new_weights_path, die_midway=True),
                           str(free_port()))
    code, out, err = _finish(trainer)
    assert code == 3 and "dying" in out, err
    assert _served(server) == old  # nothing was written; the group is gone
    r = server.admin.post("/destroy_weights_update_group", json={"group_name": "weight_update_group"})
    assert r.status_code == 400 and "no weights update group" in r.json()["error"]["message"]
    # a whole push
    trainer = _run_trainer(TRAINER_GROUP.format(url=server.url, admin=ADMIN, path=new_weights_path, die_midway=False),
                           str(free_port()))
    code, out, err = _finish(trainer)
    assert code == 0, err
    assert _served(server) == expected.new
    WeightPusher(server.url, ADMIN).push(iter_checkpoint(tiny_model_path))
    assert _served(server) == old


def test_a_trainer_whose_group_the_engine_refuses_fails_at_once(server):
    """The engine answers 403 (a wrong admin token) or 400 at once; before, the trainer still waited the whole
    rendezvous timeout for a rank that would never come, then reported that instead of the engine's answer."""
    from torpor.rl import DistributedPusher

    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"group failed: the engine answered 403.*admin token is wrong"):
        DistributedPusher(server.url, "wrong-token", "127.0.0.1", free_port(), "cpu", timeout=60)
    assert time.monotonic() - start < 15


def test_unpickler_payload_limits():
    t = torch.zeros(1024)
    torch.multiprocessing.set_sharing_strategy("file_system")
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump([("x", t)])
    with pytest.raises(RefusedPickle, match="maps more than 100 bytes"):
        RestrictedUnpickler(buffer.getvalue(), max_bytes=100).load()



NESTED_KEYS = """
    from torpor.engine.weights.payload import RefusedPickle, RestrictedUnpickler
    nested = b")" + b"\\x85" * 700_000  # a tuple 700,000 deep: 700 KB, within the server's default 1 MiB body
    for opcodes in (b"}" + nested + b"Ns", b"(" + nested + b"Nd", b"(" + nested + b"\\x91"):  # SETITEM, DICT, FROZENSET
        payload = b"\\x80\\x04" + opcodes + b"."
        try:
            RestrictedUnpickler(payload, 1 << 20).load()
            print("loaded")
        except RefusedPickle:
            print("refused")
"""


def test_a_deeply_nested_key_is_refused_not_a_crash():
    """Hashing a deeply nested tuple (a dict key, a frozenset item) recurses in C: SIGSEGV, the server gone."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(NESTED_KEYS)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert result.returncode == 0, f"the unpickler died ({result.returncode}): {result.stderr[-1000:]}"
    assert result.stdout.split() == ["refused"] * 3


def _tensor_opcodes(t: torch.Tensor) -> bytes:
    """The opcodes that rebuild `t` from shared memory (protocol 3: no frames; no PROTO, no STOP)."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    buffer = io.BytesIO()
    ForkingPickler(buffer, 3).dump(t)
    return buffer.getvalue()[2:-1]


def test_container_opcodes_fill_only_plain_containers():
    """The plain unpickler calls `x[k] = v`, `x.add(v)`, `x.append(v)` of whatever is on the stack, and a REDUCE
    of torch.Size / OrderedDict iterates any argument: none of it may reach a tensor."""
    from collections import OrderedDict

    t = torch.zeros(4, 2)
    tensor = _tensor_opcodes(t)
    for payload in (b"\x80\x03" + tensor + b"NG\x40\x1c\x00\x00\x00\x00\x00\x00s.",  # t[None] = 7.0: fills it
                    b"\x80\x03" + tensor + b"(K\x07\x90.",  # ADDITEMS: t.add(7), a new tensor the size of t
                    b"\x80\x03" + tensor + b"K\x07a.",  # APPEND
                    b"\x80\x03ccollections\nOrderedDict\n" + tensor + b"\x85R.",  # OrderedDict(t) iterates t
                    b"\x80\x03ctorch\nSize\n" + _tensor_opcodes(torch.arange(4)) + b"\x85R."):  # torch.Size(t)
        with pytest.raises(RefusedPickle, match=r"refused|takes|rebuilt empty"):
            RestrictedUnpickler(payload, 1 << 20).load()
    assert not t.any()  # the trainer's memory was not written
    ok = RestrictedUnpickler(ForkingPickler.dumps([OrderedDict(a=t), {"b": torch.Size([2, 3])}, [t]]), 1 << 20).load()
    assert ok[0]["a"].shape == (4, 2) and ok[1] == {"b": torch.Size([2, 3])} and ok[2][0].shape == (4, 2)


def test_a_tensor_view_must_lie_inside_its_storage():
    """torch's `set_` grows a resizable storage to fit the view (fresh uninitialized memory, outside the
    payload's byte budget): the view is checked against the storage first (CUDA: before the IPC handle opens)."""
    from torch.multiprocessing import reductions

    class Empty:
        def __reduce__(self):
            return reductions.rebuild_storage_empty, (torch.UntypedStorage,)

    class Typed:
        def __reduce__(self):
            return reductions.rebuild_typed_storage, (Empty(), torch.float32)

    class View:
        def __init__(self, *metadata) -> None:
            self.metadata = metadata

        def __reduce__(self):
            return reductions.rebuild_tensor, (torch.Tensor, Typed(), self.metadata)

    class CudaView:
        def __reduce__(self):
            return reductions.rebuild_cuda_tensor, (torch.Tensor, (1024,), (1,), 0, torch.storage.TypedStorage,
                                                    torch.float32, 0, b"h" * 64, 16, 0, False, b"r", 0, None, False)

    for view in (View(0, (1 << 20,), (1,), False), View(0, (2, 2), (1 << 40, 1), False), CudaView()):
        with pytest.raises(RefusedPickle, match=r"a tensor view reaches \d+ bytes into a storage of \d+ bytes"):
            RestrictedUnpickler(pickle.dumps(view), max_bytes=100).load()
    assert RestrictedUnpickler(pickle.dumps(View(0, (0, 3), (3, 1), False)), 100).load().shape == (0, 3)


def test_bad_bucket_metadata_is_a_value_error():
    """A bucket's metadata that torch cannot view, or a dtype too deeply nested to print: a 400 (ValueError)
    naming the problem, not a RuntimeError (409)."""
    flat = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"element 1 of the torch\.uint8 bucket is not aligned to torch\.float32"):
        named_tensors_of({"flattened_tensor": flat, "metadata": [("a", [1], torch.float32, 1, 5)]}, "flattened_bucket")
    nested = []
    for _ in range(100_000):
        nested = [nested]
    with pytest.raises(ValueError, match="unknown dtype"):
        named_tensors_of({"flattened_tensor": flat, "metadata": [("a", [4], nested, 0, 16)]}, "flattened_bucket")
    with pytest.raises(ValueError, match="64-bit ints"):
        named_tensors_of({"flattened_tensor": flat, "metadata": [("a", [1 << 64, 0], torch.float32, 0, 0)]},
                         "flattened_bucket")


def test_memo_references_cannot_multiply_the_tensors():
    """A list of 1,000 memo references to one bucket of 1,000 memo references to one entry: a 5 KB pickle that
    made a million views (seconds of the engine thread, a GB; a 1 MiB body: hours, the host's memory)."""
    flat = torch.zeros(4)
    bucket = {"flattened_tensor": flat, "metadata": [("a", [4], torch.float32, 0, 4)] * 1000}
    payload = pickle.dumps([bucket] * 1000)
    assert len(payload) < 5000
    with pytest.raises(ValueError, match=r"names \d+ tensors or more; at most 100000"):
        named_tensors_of(pickle.loads(payload), "flattened_bucket")
    with pytest.raises(ValueError, match="names 1000000 tensors or more"):
        named_tensors_of([("a", flat)] * 1_000_000, None)
    assert len(named_tensors_of([bucket] * 100, "flattened_bucket")) == 100_000

# ---- the process-group path in process: the trainer is a thread (its own standalone group) ----------
def _trainer_group(llm, name: str, timeout: float = 30.0):
    """A group of 2 between a trainer thread of this process (rank 0, hosting the store) and `llm` (rank 1)."""
    import threading

    from torpor.engine.weights.transport import open_update_group

    port, box = free_port(), {}
    host = threading.Thread(target=lambda: box.setdefault("group", open_update_group(
        "127.0.0.1", port, 0, 2, name, "gloo", torch.device("cpu"), timeout)))
    host.start()
    llm.init_weights_update_group("127.0.0.1", port, 1, 2, name, "gloo", timeout=timeout)
    host.join(timeout)
    return box["group"]


def _broadcast_in_thread(group, tensors):
    """The trainer's broadcasts in a thread; the result holds the error they ended with (None: all sent)."""
    import threading

    from torpor.engine.weights.transport import broadcast

    result = {}

    def send() -> None:
        try:
            for tensor in tensors:
                broadcast(group, tensor)
            result["error"] = None
        except RuntimeError as e:
            result["error"] = e

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, result


def test_a_refused_distributed_update_destroys_the_group_and_frees_the_trainer(tiny_model_path, new_weights_path,
                                                                              expected):
    """The trainer broadcasts while the engine refuses the update (an unknown name): nobody receives its
    broadcasts, so the group's stream is out of step. Before: the engine kept the group, the trainer sat
    in its broadcast for the group's whole timeout; now the group is destroyed and the trainer fails at once."""
    from torpor.engine.weights.transport import destroy_group_handle

    llm = LLM(tiny_model_path, **ENGINE)
    named = list(iter_checkpoint(new_weights_path))
    names, shapes = [n for n, _ in named], [list(t.shape) for _, t in named]
    group = _trainer_group(llm, "refused", timeout=60)
    trainer, result = _broadcast_in_thread(group, [t for _, t in named])
    with pytest.raises(ValueError, match=r"unknown tensor 'model.nope'.*'refused' is destroyed"):
        llm.update_weights_from_distributed(["model.nope", *names[1:]], ["float32"] * len(named), shapes, "refused")
    trainer.join(10)
    assert not trainer.is_alive() and result["error"] is not None  # not after the 60 s timeout
    destroy_group_handle(group)
    assert _answers(llm) == expected.old
    group = _trainer_group(llm, "refused")  # the name is free again; a whole push works
    trainer, result = _broadcast_in_thread(group, [t for _, t in named])
    assert llm.update_weights_from_distributed(names, ["float32"] * len(named), shapes, "refused") == len(named)
    trainer.join(10)
    assert result == {"error": None}
    assert _answers(llm) == expected.new
    llm.destroy_weights_update_group("refused")
    destroy_group_handle(group)


def _open_fds_and_threads() -> tuple[int, int]:
    """The process's open sockets (a group's connections; not the engine's memory files, which its close gives back
    too) and threads."""
    def is_socket(fd: str) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile
            return False

    return sum(map(is_socket, os.listdir("/proc/self/fd"))), len(os.listdir("/proc/self/task"))


def test_closing_the_engine_destroys_its_groups(tiny_model_path):
    """Before: the groups were the process's, not the engine's; a closed engine left its group's sockets and
    gloo threads behind, and the next engine of the process could not init a group of the same name."""
    import gc

    from torpor.engine.weights.transport import destroy_group_handle

    llm = LLM(tiny_model_path, **ENGINE)
    for _ in range(3):  # repeated init / destroy leaks nothing either
        group = _trainer_group(llm, "closing")
        llm.destroy_weights_update_group("closing")
        destroy_group_handle(group)
        del group
        gc.collect()
    before = _open_fds_and_threads()
    group = _trainer_group(llm, "closing")
    llm.close()
    destroy_group_handle(group)
    del group
    gc.collect()
    assert _open_fds_and_threads() == before
    llm = LLM(tiny_model_path, **ENGINE)
    group = _trainer_group(llm, "closing")
    llm.destroy_weights_update_group("closing")
    destroy_group_handle(group)


# ---- tensor parallel: every rank joins the group, keeps its shard ---------------------------------------
TP_TRAINER = """
    import sys
    sys.path.insert(0, sys.argv[3])
    from sglang_trainer import broadcast_all, trainer_group
    from torpor.engine.weights.loader import iter_checkpoint
    from torpor.rl import serialize
    named = list(iter_checkpoint(sys.argv[1]))
    for _ in range(4):  # shared-memory payloads: each pickle is opened once (by one rank)
        print(serialize(named), flush=True)
    group = trainer_group(int(sys.argv[2]), 3, "tp", timeout_s=300)  # SGLang's way: the engine's ranks join as 1 and 2
    sys.stdin.readline()  # the engine asks for the tensors
    broadcast_all(group, [t for _, t in named])
    print("sent", flush=True)
    sys.stdin.readline()
"""


@pytest.mark.slow
def test_tensor_parallel_engine_takes_both_transports(tiny_model_path, new_weights_path, expected):
    import threading

    llm = LLM(tiny_model_path, tensor_parallel_size=2, **ENGINE)
    port = free_port()
    trainer = _run_trainer(TP_TRAINER, new_weights_path, str(port), TESTS)
    try:
        payloads = [trainer.stdout.readline().strip() for _ in range(4)]
        assert all(payloads), _finish(trainer)
        # by reference, one payload: rank 0 opens it and streams it to the other rank
        assert llm.update_weights_from_tensor(serialized_named_tensors=[payloads[0]]) > 0
        assert [t for t, _ in _answers(llm)] == [t for t, _ in expected.new]
        llm.update_weights(iter_checkpoint(tiny_model_path))  # back to the old weights
        assert [t for t, _ in _answers(llm)] == [t for t, _ in expected.old]
        # one payload per rank: each rank opens its own and keeps its shard; a bad one on rank 1 writes nothing
        with pytest.raises(RankError, match="not valid base64"):
            llm.update_weights_from_tensor(serialized_named_tensors=[payloads[1], "%%%"])
        assert [t for t, _ in _answers(llm)] == [t for t, _ in expected.old]
        assert llm.update_weights_from_tensor(serialized_named_tensors=payloads[2:]) > 0
        assert [t for t, _ in _answers(llm)] == [t for t, _ in expected.new]
        llm.update_weights(iter_checkpoint(tiny_model_path))
        assert [t for t, _ in _answers(llm)] == [t for t, _ in expected.old]
        # by process group: ranks 1 and 2 of 3 are this engine's two ranks. A world of 2 cannot hold them:
        # refused before any rank joins (before: rank 0 joined the trainer's group as rank 1 of 2, rank 1 failed)
        with pytest.raises(ValueError, match=r"world_size 2 cannot hold the engine's 2 rank\(s\)"):
            llm.init_weights_update_group("127.0.0.1", port, 1, 2, "tp", "gloo", timeout=60)
        llm.init_weights_update_group("127.0.0.1", port, 1, 3, "tp", "gloo", timeout=60)
        with pytest.raises(ValueError, match="'tp' exists already"):  # and the first one stays whole
            llm.init_weights_update_group("127.0.0.1", port, 1, 3, "tp", "gloo", timeout=60)
        named = list(iter_checkpoint(new_weights_path))
        result = {}
        receive = threading.Thread(target=lambda: result.setdefault("count", llm.update_weights_from_distributed(
            [n for n, _ in named], ["float32"] * len(named), [list(t.shape) for _, t in named], "tp")))
        receive.start()
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        receive.join(120)
        assert trainer.stdout.readline().strip() == "sent"
        assert result.get("count", 0) > 0
        llm.destroy_weights_update_group("tp")
        assert [t for t, _ in _answers(llm)] == [t for t, _ in expected.new]
    finally:
        llm.close()
        _finish(trainer)


DYING_TRAINER = """
    from torpor.engine.weights.loader import iter_checkpoint
    from torpor.rl import serialize
    print(serialize(list(iter_checkpoint({path!r}))), flush=True)
"""


@pytest.mark.slow
def test_a_payload_whose_memory_is_gone_is_a_clear_error(tiny_model_path, new_weights_path, expected):
    """The trainer exited and its shared memory was removed before the engine opened it."""
    import glob

    llm = LLM(tiny_model_path, **ENGINE)
    trainer = _run_trainer(DYING_TRAINER.format(path=new_weights_path))
    payload = trainer.stdout.readline().strip()
    code, _, err = _finish(trainer)
    assert code == 0 and payload, err
    files = glob.glob(f"/dev/shm/torch_{trainer.pid}_*")
    assert files  # the pickler keeps them for the receiver, even after the trainer exits
    for file in files:
        os.unlink(file)
    with pytest.raises(ValueError, match=r"does not exist \(the trainer freed it, or died\)"):
        llm.update_weights_from_tensor(serialized_named_tensors=[payload])
    assert _answers(llm) == expected.old


def _gloo_pair() -> dict:
    """Ranks 0 (the trainer) and 1 (the engine) of one gloo group, both in this process."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    host = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=20), wait_for_workers=False)
    groups = {}

    def join(rank: int) -> None:
        store = host if rank == 0 else dist.TCPStore("127.0.0.1", host.port, 2, False, timeout=timedelta(seconds=20))
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("pair/", store), rank, 2, timedelta(seconds=60))

    joining = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for t in joining:
        t.start()
    for t in joining:
        t.join(30)
    return groups


def test_waiting_for_broadcasts_is_bounded_and_reports_a_trainer_gone():
    """`await_work`, what an NCCL receive waits with instead of a CUDA synchronize (which would wait forever for a
    trainer that died mid-broadcast), over real gloo works: the trainer late, then in time, then gone."""
    import torch.distributed as dist

    groups = _gloo_pair()
    options = dist.BroadcastOptions()
    options.rootRank = 0
    received = torch.zeros(4)
    work = groups[1].broadcast([received], options)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not complete within 0\.5 s"):
        await_work(work, 0.5)
    assert 0.5 <= time.monotonic() - start < 5
    sent = groups[0].broadcast([torch.arange(4.0)], options)
    await_work(work, 30)  # the late broadcast arrives: the same work completes
    assert received.tolist() == [0.0, 1.0, 2.0, 3.0]
    sent.wait()
    pending = groups[1].broadcast([torch.zeros(4)], options)
    del groups[0], sent  # the trainer's end closes: its sockets go
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the broadcast failed"):
        await_work(pending, 30)
    assert time.monotonic() - start < 10  # at once, not at the timeout
