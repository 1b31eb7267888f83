"""vLLM's native weight transfer (torpor/engine/weights/transfer.py, server/vllm_api.py): the four phases over HTTP
from trainer processes (ipc: shared-memory files in vLLM's handle shapes, packed too; nccl: a gloo group the
trainer forms while the engine joins, broadcasts while update_weights is pending, packed too), and the rule every
path keeps: nothing serves before finish, and a refused chunk, an abandoned update or a trainer gone never serves a
mix. Also SGLang's /update_weights_from_disk and /get_weights_by_name, and the open control plane."""

import base64
import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import torch
from server_thread import ServerThread, wait_for

from torpor.engine import LLM, SamplingParams
from torpor.engine.weights.loader import iter_checkpoint
from torpor.rl.engine_process import free_port
from torpor.rl.vllm_transfer import ipc_update_info, packed_ipc_update_infos, pickle_handles
from torpor.server import ServerConfig, build_app
from torpor.synthetic import make_model

ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=8, block_size=4)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [7, 8, 9]]
ADMIN = "admin-secret"
IDLE_S = 1.5  # the servers' push_idle_timeout_s
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def paths(tmp_path_factory, tiny_model_path) -> SimpleNamespace:
    new = make_model("tiny", tmp_path_factory.mktemp("tiny-seed1") / "tiny", seed=1, dtype="float32", progress=False)
    return SimpleNamespace(old=tiny_model_path, new=str(new), root=str(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="module")
def expected(paths) -> SimpleNamespace:
    return SimpleNamespace(old=_answers(LLM(paths.old, **ENGINE)), new=_answers(LLM(paths.new, **ENGINE)))


def _answers(llm) -> list:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _server(path: str, backend: str, root: str, **options):
    llm = LLM(path, **ENGINE, weight_transfer_config={"backend": backend}, **options)
    config = ServerConfig("tiny", admin_token=ADMIN, push_idle_timeout_s=IDLE_S, allowed_weights_dir=root)
    thread = ServerThread(build_app(llm.engine, config))
    url = thread.__enter__()
    admin = httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {ADMIN}"})
    return SimpleNamespace(url=url, llm=llm, admin=admin, thread=thread)


@pytest.fixture(scope="module")
def ipc(paths):
    server = _server(paths.old, "ipc", paths.root, worker_extension_cls="openrlhf_worker_wrap.WorkerWrap")
    yield server
    server.thread.__exit__(None, None, None)


@pytest.fixture(scope="module")
def nccl(paths):
    server = _server(paths.old, "nccl", paths.root)
    yield server
    server.thread.__exit__(None, None, None)


def _served(server) -> list:
    out = []
    for prompt in PROMPTS:
        r = server.admin.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["token_ids"])
    return out


def _serving(server) -> bool:
    return server.admin.get("/health").json()["serving"]


def _trainer(code: str, *args: str) -> subprocess.Popen:
    err = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in _finish)
    process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                               env={**os.environ, "PYTHONPATH": ROOT})
    process.err_file = err
    return process


def _finish(process: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    process.stdin.close()
    code = process.wait(timeout)
    out = process.stdout.read()
    process.err_file.seek(0)
    err = process.err_file.read()
    process.err_file.close()
    return code, out, err


def _put_back(server, path: str) -> None:
    """The old weights again (a reload: a level-1 sleep and wake leave their host copy current)."""
    assert server.admin.post("/reload_weights", json={"path": path}).status_code == 200


# ---- ipc: the trainer's tensors by reference ------------------------------------------------------------------
IPC_TRAINER = """
    import sys, threading, httpx, json
    from torpor.engine.weights.loader import iter_checkpoint
    from torpor.rl.vllm_transfer import HTTPWeightTransferClient, ipc_update_info, packed_ipc_update_infos
    url, admin, path = sys.argv[1:4]
    client = HTTPWeightTransferClient(url, admin)
    named = list(iter_checkpoint(path))
    half = len(named) // 2
    print(json.dumps(client.init_weight_transfer_engine({})), flush=True)
    print(json.dumps(client.start_weight_update()), flush=True)
    sys.stdin.readline()  # the test checks that nothing serves meanwhile
    answers = [client.update_weights(ipc_update_info(named[:half]))]  # one handle per tensor
    for info in packed_ipc_update_infos(named[half:], buffer_bytes=64 << 10):  # vLLM's packed chunks, one buffer
        answers.append(client.update_weights(info))
    print(len(answers), json.dumps(sorted({json.dumps(a) for a in answers})), flush=True)
    sys.stdin.readline()
    print(json.dumps(client.finish_weight_update("step-1")), flush=True)
"""


@pytest.mark.slow
def test_ipc_four_phase_from_a_trainer_process_serves_only_after_finish(ipc, paths, expected):
    assert _served(ipc) == expected.old
    trainer = _trainer(IPC_TRAINER, ipc.url, ADMIN, paths.new)
    assert trainer.stdout.readline().strip() == '{"message": "Weight transfer initialized"}'
    assert trainer.stdout.readline().strip() == '{"message": "Weight update started"}'
    wait_for(lambda: not _serving(ipc), what="the update to hold the engine")
    answers = {}
    request = threading.Thread(target=lambda: answers.update(r=httpx.post(
        f"{ipc.url}/v1/completions", timeout=60, json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8,
                                                       "temperature": 0, "ignore_eos": True,
                                                       "return_token_ids": True})))
    request.start()  # sent during the update: it waits, and is answered by the new weights
    trainer.stdin.write("go\n")
    trainer.stdin.flush()
    count, answers_seen = trainer.stdout.readline().split(" ", 1)
    assert int(count) >= 3 and json.loads(answers_seen) == ['{"message": "Weights updated"}']  # packed: >= 2 fills
    assert request.is_alive() and not _serving(ipc)  # every chunk written, nothing served before finish
    trainer.stdin.write("go\n")
    trainer.stdin.flush()
    code, out, err = _finish(trainer)
    assert code == 0, err
    assert out.strip() == '{"message": "Weight update finished"}'
    request.join(60)
    assert answers["r"].json()["choices"][0]["token_ids"] == expected.new[0]
    assert _served(ipc) == expected.new
    assert ipc.admin.get("/get_model_info").json()["weight_version"] == "step-1"
    new = dict(iter_checkpoint(paths.new))
    norm = ipc.admin.request("GET", "/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 5})
    assert norm.json() == new["model.norm.weight"][:5].tolist()
    rows = ipc.admin.post("/get_weights_by_name", json={"name": "model.layers.0.self_attn.k_proj.weight",
                                                        "truncate_size": 2}).json()
    assert rows == new["model.layers.0.self_attn.k_proj.weight"][:2].tolist()  # a fused tensor's part, SGLang's rows
    _put_back(ipc, paths.old)
    assert _served(ipc) == expected.old


def test_a_refused_chunk_ends_the_update_and_never_serves_a_mix(ipc, paths, expected):
    named = list(iter_checkpoint(paths.new))
    post = ipc.admin.post
    # Reverted from the host copy: a level-1 sleep and wake leave it current.
    assert post("/sleep", params={"level": 1}).status_code == 200 and post("/wake_up").json()["serving"]
    assert post("/start_weight_update").json() == {"message": "Weight update started"}
    info = ipc_update_info(named[:4])
    assert post("/update_weights", json={"update_info": info}).status_code == 200
    bad = ipc_update_info([("model.no_such.weight", torch.zeros(3))])
    error = post("/update_weights", json={"update_info": bad})
    assert error.status_code == 400 and "unknown tensor 'model.no_such.weight'" in error.json()["error"]["message"]
    finish = post("/finish_weight_update", json={"weight_version": "never"})
    assert finish.status_code == 409 and "ended without committing" in finish.json()["error"]["message"]
    assert _serving(ipc) and _served(ipc) == expected.old  # the four written tensors were put back
    assert ipc.admin.get("/get_model_info").json()["weight_version"] != "never"
    # Without a current host copy (a reload left none): the part written is a mix, which never serves.
    _put_back(ipc, paths.old)
    assert post("/start_weight_update").status_code == 200
    assert post("/update_weights", json={"update_info": ipc_update_info(named[:4])}).status_code == 200
    shape = [s + 1 for s in named[5][1].shape]
    wrong = ipc_update_info([(named[5][0], torch.zeros(shape))])
    assert post("/update_weights", json={"update_info": wrong}).status_code == 400
    assert not _serving(ipc)
    assert "not written" in ipc.admin.get("/health").text or not ipc.admin.get("/health").json()["serving"]
    assert post("/start_weight_update").status_code == 200  # a complete update makes it serve again
    assert post("/update_weights", json={"update_info": ipc_update_info(list(iter_checkpoint(paths.old)))}).json() \
        == {"message": "Weights updated"}
    assert post("/finish_weight_update").status_code == 200
    assert _serving(ipc) and _served(ipc) == expected.old


def test_an_abandoned_update_is_given_up_after_the_idle_timeout(ipc, paths, expected):
    post = ipc.admin.post
    assert post("/sleep", params={"level": 1}).status_code == 200 and post("/wake_up").json()["serving"]
    assert post("/start_weight_update").status_code == 200
    assert post("/update_weights", json={"update_info": ipc_update_info(list(iter_checkpoint(paths.new))[:3])}) \
        .status_code == 200
    assert not _serving(ipc)
    started = time.monotonic()
    wait_for(lambda: _serving(ipc), timeout=IDLE_S + 10, what="the idle update to be given up")
    assert time.monotonic() - started >= IDLE_S - 0.5
    assert _served(ipc) == expected.old  # reverted: the trainer that went quiet left no mix
    finish = post("/finish_weight_update")
    assert finish.status_code == 409 and "no call of it came" in finish.json()["error"]["message"]


def test_bad_bodies_are_400s_naming_the_field(ipc, nccl):
    post = ipc.admin.post
    assert post("/init_weight_transfer_engine", json={}).json()["error"]["param"] == "init_info"
    error = post("/init_weight_transfer_engine", json={"init_info": {"master_port": 1}}).json()["error"]
    assert "unknown field(s) ['master_port']" in error["message"]  # ipc takes {}
    assert post("/start_weight_update", json={"include_draft": True}).status_code == 400
    assert post("/start_weight_update", json={"is_checkpoint_format": False}).status_code == 400
    assert post("/start_weight_update", json={"bogus": 1}).json()["error"]["param"] == "bogus"
    assert post("/start_draft_weight_update").status_code == 400
    assert "no weight update is in progress" in post("/update_weights", json={"update_info": {}}).text
    assert post("/start_weight_update", json={"is_checkpoint_format": True}).status_code == 200  # TRL's body
    assert post("/start_weight_update").status_code == 409  # one at a time
    assert post("/update_weights", json={"update_info": {"names": ["a"], "dtype_names": ["float32"],
                                                         "shapes": [[1]], "ipc_handles": [{}]}}).status_code == 400
    assert post("/finish_weight_update", json={"weight_version": 3}).status_code == 400
    assert post("/finish_weight_update", json={}).json() == {"message": "Weight update finished"}
    marker = os.path.join(tempfile.gettempdir(), f"torpor-evil-{os.getpid()}")

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    assert post("/start_weight_update").status_code == 200
    evil = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[64]],
            "ipc_handles_pickled": base64.b64encode(pickle.dumps([{"cpu": Evil()}])).decode()}
    error = post("/update_weights", json={"update_info": evil}).json()["error"]["message"]
    assert "refused to unpickle posix.system" in error and not os.path.exists(marker)
    assert post("/finish_weight_update").status_code == 409  # the refused chunk ended it
    # nccl: start before init is out of order; a bad init is a 400 and nothing joins
    assert nccl.admin.post("/start_weight_update").status_code == 409
    error = nccl.admin.post("/init_weight_transfer_engine", json={"init_info": {"master_address": "127.0.0.1"}})
    assert "missing field(s)" in error.json()["error"]["message"]
    error = nccl.admin.post("/init_weight_transfer_engine", json={"init_info": {"nccl_unique_id_b64": "x"}})
    assert "nccl_unique_id_b64 is not supported" in error.json()["error"]["message"]
    assert nccl.admin.get("/get_world_size", params={"include_dp": "true"}).json() == {"world_size": 1}


# ---- nccl: a process group to the trainer (gloo on CPU) ---------------------------------------------------
NCCL_TRAINER = """
    import sys, json
    from torpor.engine.weights.loader import iter_checkpoint
    from torpor.rl.vllm_transfer import HTTPWeightTransferClient, send_weights, trainer_init
    import threading
    url, admin, path, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    client = HTTPWeightTransferClient(url, admin)
    world = 1 + client.http.get("/get_world_size").json()["world_size"]
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world}
    joining = threading.Thread(target=client.init_weight_transfer_engine, args=(init,))
    joining.start()  # the engine joins while this process, rank 0, forms the group
    group = trainer_init(init, "cpu", timeout_s=30)
    joining.join()
    print("joined", flush=True)
    named = list(iter_checkpoint(path))
    for packed in (False, True):  # one tensor per broadcast, then vLLM's packed buffers
        send_weights(client, named, group, packed=packed, weight_version=f"packed-{packed}")
        print("updated", packed, flush=True)
    if sys.stdin.readline().strip() == "die":  # an update whose trainer dies mid-broadcast
        client.start_weight_update()
        from torpor.rl.vllm_transfer import nccl_update_info
        threading.Thread(target=client.update_weights, args=(nccl_update_info(named),), daemon=True).start()
        from torpor.engine.weights.transport import broadcast
        broadcast(group, named[0][1])
        print("dying", flush=True)
        import os
        os._exit(1)
"""


@pytest.mark.slow
def test_nccl_four_phase_with_a_trainer_broadcasting_and_a_trainer_gone(nccl, paths, expected):
    assert _served(nccl) == expected.old
    trainer = _trainer(NCCL_TRAINER, nccl.url, ADMIN, paths.new, str(free_port()))
    assert trainer.stdout.readline().strip() == "joined", trainer.err_file
    assert trainer.stdout.readline().strip() == "updated False"
    assert trainer.stdout.readline().strip() == "updated True"
    assert _served(nccl) == expected.new
    assert nccl.admin.get("/get_model_info").json()["weight_version"] == "packed-True"
    again = nccl.admin.post("/init_weight_transfer_engine", json={"init_info": {
        "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}})
    assert again.status_code == 400 and "called already" in again.json()["error"]["message"]
    trainer.stdin.write("die\n")
    trainer.stdin.flush()
    assert trainer.stdout.readline().strip() == "dying"
    trainer.wait(30)
    wait_for(lambda: _serving(nccl), timeout=60, what="the failed update to end")
    assert _served(nccl) == expected.new  # the trainer died mid-update: nothing of it was written
    finish = nccl.admin.post("/finish_weight_update")
    assert finish.status_code == 409 and "ended without committing" in finish.json()["error"]["message"]
    assert "not up" in nccl.admin.post("/start_weight_update").json()["error"]["message"]  # the group was given up
    trainer.err_file.close()


# ---- the LLM: the same four phases in process; worker extensions and collective_rpc -------------------------
def test_llm_four_phase_in_process_and_generate_waits_for_finish(paths, expected):
    llm = LLM(paths.old, **ENGINE, weight_transfer_config={"backend": "ipc"})
    with pytest.raises(ValueError, match="weight_transfer_config: backend must be one of"):
        LLM(paths.old, **ENGINE, weight_transfer_config={"backend": "sparse_nccl"})
    with pytest.raises(ValueError, match="unknown field"):
        LLM(paths.old, **ENGINE, weight_transfer_config={"backend": "ipc", "packed": True})
    llm.init_weight_transfer_engine({"init_info": {}})
    llm.start_weight_update()
    with pytest.raises(RuntimeError, match=r"weight update .* is in progress"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    named = list(iter_checkpoint(paths.new))
    assert llm.update_weights({"update_info": ipc_update_info(named, pickled=False)}) > 0
    llm.finish_weight_update("v2")
    assert _answers(llm) == expected.new and llm.engine.weight_version == "v2"
    with pytest.raises(RuntimeError, match="no weight update is in progress"):
        llm.finish_weight_update()
    llm.start_weight_update()  # vLLM's newest handle form: reduce_tensor's arguments alone, pickled
    info = ipc_update_info(list(iter_checkpoint(paths.old)), pickled=False)
    info["ipc_handles_pickled"] = pickle_handles([{"cpu": entry["cpu"][1]} for entry in info.pop("ipc_handles")])
    llm.update_weights({"update_info": info})
    llm.finish_weight_update()
    assert _answers(llm) == expected.old
    named = list(iter_checkpoint(paths.new))  # packed chunks of a buffer smaller than the largest tensor
    largest = max(t.numel() * t.element_size() for _, t in named)
    llm.start_weight_update()
    infos = list(packed_ipc_update_infos(named, buffer_bytes=largest // 4, pickled=False))
    assert max(sum(i["tensor_sizes"]) for i in infos) == largest  # that one alone, in the grown buffer
    for info in packed_ipc_update_infos(named, buffer_bytes=largest // 4, pickled=False):
        llm.update_weights({"update_info": info})
    llm.finish_weight_update()
    assert _answers(llm) == expected.new
    off = LLM(paths.old, **ENGINE)
    with pytest.raises(ValueError, match="weight transfer is not configured"):
        off.init_weight_transfer_engine({"init_info": {}})


OPENRLHF_TRAINER = """
    import sys
    sys.path.insert(0, {tests!r})
    from sglang_trainer import broadcast_all, trainer_group
    from torpor.engine.weights.loader import iter_checkpoint
    port, world = int(sys.argv[1]), int(sys.argv[2])
    group = trainer_group(port, world, "openrlhf", timeout_s=60)
    print("joined", flush=True)
    for _ in range(2):
        broadcast_all(group, [t for _, t in iter_checkpoint({path!r})])
        print("sent", flush=True)
    sys.stdin.readline()  # the engine left the group
    import os
    os._exit(0)  # no teardown of a gloo group whose peers are gone
"""


@pytest.mark.slow
def test_an_openrlhf_worker_extension_across_ranks_writes_through_the_engine(paths, expected):
    """OpenRLHF's shape: init_process_group then one update_weight per parameter, by collective_rpc, on both ranks
    of a tensor-parallel engine (the extension in each rank's process), the trainer broadcasting from rank 0."""
    llm = LLM(paths.old, **ENGINE, tensor_parallel_size=2, worker_extension_cls="openrlhf_worker_wrap.WorkerWrap",
              weight_transfer_config={"backend": "ipc"})  # for start/finish_weight_update around the calls
    try:
        assert llm.collective_rpc("report", args=("rank",)) == ["rank 0 of 2", "rank 1 of 2"]
        assert llm.collective_rpc(lambda worker, k: worker.rank * k, args=(10,)) == [0, 10]  # by value: cloudpickle
        with pytest.raises(ValueError, match="unknown collective_rpc method 'load_weights'"):
            llm.collective_rpc("load_weights", args=([], False))  # the engine's own path, not offered
        port = free_port()
        trainer = _trainer(OPENRLHF_TRAINER.format(tests=os.path.join(ROOT, "tests"), path=paths.new), str(port), "3")
        llm.collective_rpc("init_process_group", args=("127.0.0.1", port, 1, 3, "openrlhf", "gloo", False))
        assert trainer.stdout.readline().strip() == "joined"
        named = list(iter_checkpoint(paths.new))
        for name, tensor in named:  # each call is one update: committed when it returns
            llm.collective_rpc("update_weight", args=(name, str(tensor.dtype), list(tensor.shape)))
        assert trainer.stdout.readline().strip() == "sent"
        assert _answers(llm) == expected.new
        llm.reload_weights(paths.old)
        llm.start_weight_update()  # inside the four phases the per-parameter calls are one update
        for name, tensor in named:
            llm.collective_rpc("update_weight", args=(name, str(tensor.dtype), list(tensor.shape)))
            assert not llm.engine.serving
        assert trainer.stdout.readline().strip() == "sent"
        llm.finish_weight_update("openrlhf-2")
        assert _answers(llm) == expected.new and llm.engine.weight_version == "openrlhf-2"
        llm.collective_rpc("destroy_process_group")
        code, _, err = _finish(trainer)
        assert code == 0, err
        llm.start_weight_update()  # the ipc backend on both ranks: each opens the shared-memory files itself
        llm.update_weights({"update_info": ipc_update_info(list(iter_checkpoint(paths.old)))})
        llm.finish_weight_update()
        assert _answers(llm) == expected.old
    finally:
        llm.close()


def test_collective_rpc_over_http_answers_as_vllm(ipc):
    rpc = ipc.admin.post
    answer = rpc("/collective_rpc", json={"method": "report", "args": ["worker"]}).json()
    assert answer == {"results": ["worker 0 of 1"]}
    assert rpc("/collective_rpc", json={"method": "describe"}).json() == {"results": [{"rank": 0, "device": "cpu"}]}
    assert rpc("/collective_rpc", json={"method": "counted", "timeout": 5}).json() == {"results": ["41"]}
    assert rpc("/collective_rpc", json={"method": "info"}).json()["results"][0]["rank"] == 0
    error = rpc("/collective_rpc", json={"method": "revert_weights"}).json()["error"]
    assert error["param"] == "method" and "unknown collective_rpc method 'revert_weights'" in error["message"]
    assert rpc("/collective_rpc", json={"method": "report", "args": [1, 2, 3]}).status_code == 400


# ---- SGLang's update_weights_from_disk and get_weights_by_name ---------------------------------------------
def test_update_weights_from_disk_honours_or_refuses_each_field(ipc, paths, expected):
    post = ipc.admin.post
    answer = post("/update_weights_from_disk", json={"model_path": paths.new, "weight_version": "disk-1",
                                                     "abort_all_requests": True, "torch_empty_cache": True,
                                                     "recapture_cuda_graph": True, "flush_cache": True})
    assert answer.status_code == 200, answer.text
    assert answer.json()["success"] is True and answer.json()["num_paused_requests"] == 0
    assert set(answer.json()) == {"success", "message", "num_paused_requests"}
    assert _served(ipc) == expected.new and ipc.admin.get("/get_model_info").json()["weight_version"] == "disk-1"
    for field, value in [("is_async", True), ("keep_pause", True), ("token_step", 3), ("manifest", {}),
                         ("load_format", "dummy")]:
        error = post("/update_weights_from_disk", json={"model_path": paths.old, field: value}).json()["error"]
        assert error["param"] == field, error
    assert post("/update_weights_from_disk", json={"model_path": "/etc"}).status_code == 403
    assert post("/update_weights_from_disk", json={"model_path": paths.old, "bogus": 1}).json()["error"]["param"] \
        == "bogus"
    assert post("/update_weights_from_disk", json={"model_path": paths.old}).status_code == 200
    assert _served(ipc) == expected.old
    assert post("/get_weights_by_name", json={"name": "model.nope"}).status_code == 400
    assert post("/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": -1}).status_code == 400
    rows = post("/get_weights_by_name", json={"name": "model.embed_tokens.weight", "truncate_size": 1 << 30}).json()
    assert len(rows) == dict(iter_checkpoint(paths.old))["model.embed_tokens.weight"].shape[0]  # every row


# ---- the open control plane ---------------------------------------------------------------------------------
def test_an_open_control_plane_is_opt_in_loopback_only_and_logged(tiny_model_path, caplog):
    with pytest.raises(ValueError, match="choose one"):
        ServerConfig("tiny", admin_token="x", control_plane_auth="none")
    with pytest.raises(ValueError, match="control_plane_auth must be"):
        ServerConfig("tiny", control_plane_auth="open")
    llm = LLM(tiny_model_path, **ENGINE)
    with caplog.at_level(logging.WARNING, logger="torpor.server"), \
            ServerThread(build_app(llm.engine, ServerConfig("tiny", control_plane_auth="none"))) as url:
        assert httpx.get(f"{url}/memory").status_code == 200  # no token
        assert httpx.post(f"{url}/sleep", params={"level": 1}).status_code == 200
        assert httpx.post(f"{url}/wake_up").json()["serving"]
    assert any("control plane is OPEN" in r.message for r in caplog.records)
    with ServerThread(build_app(llm.engine, ServerConfig("tiny"))) as url:
        assert httpx.get(f"{url}/memory").status_code == 403  # the default: the admin token, none set
    refused = subprocess.run([sys.executable, "-m", "torpor", "serve", tiny_model_path, "--host", "0.0.0.0",
                              "--port", "0", "--control-plane-auth", "none"], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert refused.returncode == 2 and "refused unless the server listens on a loopback address" in refused.stderr
