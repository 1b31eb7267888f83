"""Dying, stalling and lying trainers against the weight-update paths, with real processes: a `torpor serve` of the
tiny fp32 model (a trainer mistake that ended it would fail a test, not the run) or a server thread with a short idle
timeout, and trainer processes killed with SIGKILL at chosen points. Each test checks what a user relies on: the
engine answers the reference prompts bit for bit as before (or refuses, naming what is missing), nothing waits past
its bound, /health tells the truth, and afterwards the engine holds nothing of the trainer's (file descriptors,
sockets, threads, mappings of its shared memory)."""

from __future__ import annotations

import math
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch.distributed as dist
from server_thread import ServerThread, wait_for
from sglang_trainer import trainer_group

from torpor.engine import LLM
from torpor.engine.weights.loader import iter_checkpoint
from torpor.rl.engine_process import EngineProcess, free_port
from torpor.server import ServerConfig, build_app

from .test_vllm_weight_transfer import ENGINE as TRANSFER_ENGINE
from .test_vllm_weight_transfer import _served as _served_by_thread
from .test_weight_groups import ADMIN, SERVE, TESTS, _served, _trainer
from .test_weights_atomic import scaled_checkpoint

IDLE_S = 1.0  # the server thread's push_idle_timeout_s


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    with EngineProcess(tiny_model_path, SERVE, admin_token=ADMIN) as process:
        process.old = _served(process)
        yield process


def _alive(engine: EngineProcess) -> None:
    assert engine.process.poll() is None, f"the engine died ({engine.process.returncode}):\n{engine.output()}"


def _holdings(pid: int) -> tuple[int, int]:
    """A process's open file descriptors and threads."""
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def _wait_back_to(pid: int, before: tuple[int, int], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while any(now > then for now, then in zip(_holdings(pid), before, strict=True)):
        assert time.monotonic() < deadline, f"the engine holds more than before: {_holdings(pid)} > {before}"
        time.sleep(0.05)


def _shared_memory_of(pid: int) -> list[str]:
    """The files of process `pid` (torch names them /dev/shm/torch_<pid>_...)."""
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"torch_{pid}_")]


def _mapped_shared_memory(pid: int, owner: int) -> list[str]:
    """The mappings process `pid` holds of the shared-memory files of process `owner`."""
    with open(f"/proc/{pid}/maps") as maps:
        return [line.split()[-1] for line in maps if f"/dev/shm/torch_{owner}_" in line]


def _join(engine: EngineProcess, name: str, timeout: float = 30):
    """The engine joins `name` while this process hosts it as rank 0 (a trainer formed as SGLang's users form it)."""
    port, replies = free_port(), {}

    def post() -> None:
        replies["init"] = engine.http.post("/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": name, "backend": "gloo", "timeout": timeout})

    joining = threading.Thread(target=post)
    joining.start()
    group = trainer_group(port, 2, name, timeout_s=timeout)
    joining.join(60)
    assert replies["init"].status_code == 200, replies["init"].text
    return group


def _update_body(path: str, name: str, **extra) -> dict:
    named = list(iter_checkpoint(path))
    return {"names": [n for n, _ in named], "dtypes": ["float32"] * len(named),
            "shapes": [list(t.shape) for _, t in named], "group_name": name, **extra}


# ---- SGLang's process-group update -------------------------------------------------------------------------
@pytest.mark.parametrize("timeout", [-1, 0, 1e308, 1e9])
def test_a_receive_timeout_out_of_range_is_refused_in_the_apis_words(engine, new_weights_path, timeout):
    """Before: -1 and 0 were a 409 "did not arrive within -1 s", 1e308 the 409 "Python int too large to convert to C
    int" (gloo's), and 1e9 a receive that could wait 30 years, the engine refusing to sleep meanwhile."""
    group = _join(engine, "bad-timeout")
    try:
        reply = engine.http.post("/update_weights_from_distributed",
                                 json=_update_body(new_weights_path, "bad-timeout", timeout=timeout), timeout=20)
        assert reply.status_code == 400, reply.text
        assert f"timeout must be a number of seconds in (0, 3600], got {timeout!r}" in reply.json()["error"]["message"]
    finally:
        dist.destroy_process_group(group)
    _alive(engine)
    assert "no weights update group" in engine.http.post("/destroy_weights_update_group", json={
        "group_name": "bad-timeout"}).text  # refused: the trainer's broadcasts have no receiver, the group went
    assert _served(engine) == engine.old


def test_destroying_a_group_that_receives_is_refused_and_never_stalls_inference(engine, new_weights_path):
    """A trainer that joined and stalls, then calls destroy_weights_update_group (its clean-up path): before, the
    destroy ran on the engine thread and waited in gloo's destructor for the broadcast in flight, until the
    receive's deadline; every request waited with it while /health said "serving"."""
    group = _join(engine, "stalled")
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(engine.http.post, "/update_weights_from_distributed",
                              json=_update_body(new_weights_path, "stalled", timeout=4))
        time.sleep(0.3)
        start = time.monotonic()
        destroy = engine.http.post("/destroy_weights_update_group", json={"group_name": "stalled"}, timeout=3)
        assert destroy.status_code == 409, destroy.text
        assert "'stalled' is receiving the trainer's broadcasts" in destroy.json()["error"]["message"]
        assert _served(engine) == engine.old and time.monotonic() - start < 2  # not at the receive's deadline
        assert engine.http.get("/health").json()["serving"] and not pending.done()
        answer = pending.result(30)
    assert answer.status_code == 409 and "failed after 0 of" in answer.text, answer.text
    dist.destroy_process_group(group)
    assert "no weights update group 'stalled'" in engine.http.post("/destroy_weights_update_group", json={
        "group_name": "stalled"}).text  # the receive's failure destroyed it
    _alive(engine)


KILLED_TRAINER = """
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from sglang_trainer import broadcast_all, trainer_group
    from torpor.engine.weights.loader import iter_checkpoint
    group = trainer_group(int(sys.argv[1]), 2, "killed", timeout_s=30)
    print("joined", flush=True)
    sent = int(sys.stdin.readline())
    broadcast_all(group, [t for _, t in list(iter_checkpoint(sys.argv[3]))[:sent]])
    print("sent", flush=True)
    time.sleep(600)  # killed here
"""


@pytest.mark.parametrize("sent", [0, 1])
def test_a_trainer_killed_mid_broadcast_fails_at_once_and_leaves_nothing(engine, new_weights_path, sent):
    """kill -9 after 0 or 1 of the broadcasts: the update is a 409 at once (not at its 20 s timeout) saying how many
    arrived, the engine serves its old weights bit for bit, and holds no more descriptors or threads than before."""
    before = _holdings(engine.pid)
    port = free_port()
    trainer = _trainer(KILLED_TRAINER, str(port), TESTS, new_weights_path)
    try:
        init = engine.http.post("/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "killed", "backend": "gloo", "timeout": 30})
        assert init.status_code == 200, init.text
        assert trainer.stdout.readline().strip() == "joined"
        with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=engine.url, timeout=60, headers={
                "Authorization": f"Bearer {ADMIN}"}) as client:
            pending = pool.submit(client.post, "/update_weights_from_distributed",
                                  json=_update_body(new_weights_path, "killed", timeout=20))
            trainer.stdin.write(f"{sent}\n")
            trainer.stdin.flush()
            assert trainer.stdout.readline().strip() == "sent"
            os.kill(trainer.pid, signal.SIGKILL)
            start = time.monotonic()
            answer = pending.result(30)
        assert time.monotonic() - start < 5, "the update waited for its timeout"
        assert answer.status_code == 409, answer.text
        assert f"'killed' failed after {sent} of" in answer.json()["error"]["message"]
    finally:
        trainer.kill()
        trainer.wait(30)
        trainer.err_file.close()
    _alive(engine)
    assert engine.http.get("/health").json()["serving"] and _served(engine) == engine.old
    _wait_back_to(engine.pid, before)


# ---- vLLM's four phases (ipc: shared memory on CPU) ------------------------------------------------------------
@pytest.fixture(scope="module")
def ipc(tiny_model_path):
    llm = LLM(tiny_model_path, **TRANSFER_ENGINE, weight_transfer_config={"backend": "ipc"})
    config = ServerConfig("tiny", admin_token=ADMIN, push_idle_timeout_s=IDLE_S)
    with ServerThread(build_app(llm.engine, config)) as url:
        admin = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {ADMIN}"})
        server = SimpleNamespace(url=url, llm=llm, admin=admin)
        server.old = _served_by_thread(server)
        yield server


IPC_TRAINER = """
    import json, sys, time
    from torpor.engine.weights.loader import iter_checkpoint
    from torpor.rl.vllm_transfer import HTTPWeightTransferClient, ipc_update_info
    client = HTTPWeightTransferClient(sys.argv[1], sys.argv[2])
    named = list(iter_checkpoint(sys.argv[3]))
    client.init_weight_transfer_engine({})
    client.start_weight_update()
    print(json.dumps(client.update_weights(ipc_update_info(named[:6]))), flush=True)
    time.sleep(600)  # killed here, its tensors still in shared memory
"""


@pytest.mark.parametrize("host_copy", [True, False], ids=["host-copy-current", "no-host-copy"])
def test_a_vllm_ipc_trainer_killed_mid_update_never_serves_a_mix_and_leaves_nothing(ipc, new_weights_path, host_copy):
    post = ipc.admin.post
    if host_copy:  # the RL order: a level-1 sleep and wake leave the weights' host copy current
        assert post("/sleep", params={"level": 1}).status_code == 200 and post("/wake_up").json()["serving"]
    else:  # a reload leaves none
        assert post("/reload_weights").status_code == 200
    trainer = _trainer(IPC_TRAINER, ipc.url, ADMIN, new_weights_path)
    try:
        assert trainer.stdout.readline().strip() == '{"message": "Weights updated"}', trainer.err_file
        assert _shared_memory_of(trainer.pid) and not ipc.admin.get("/health").json()["serving"]
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(30)
        assert not _mapped_shared_memory(os.getpid(), trainer.pid)  # each chunk's mappings went with its copy
        wait_for(lambda: ipc.llm.engine.lifecycle.updating is None, 10 * IDLE_S, "the idle update to be given up")
        finish = post("/finish_weight_update", json={"weight_version": "never"})
        assert finish.status_code == 409 and "ended without committing" in finish.json()["error"]["message"]
        if host_copy:
            assert ipc.admin.get("/health").json()["serving"] and _served_by_thread(ipc) == ipc.old
        else:  # six tensors written, the rest not: refused, naming what is missing, never served
            refused = post("/v1/completions", headers={"X-Asleep-Timeout": "0.2"}, json={
                "model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2})
            assert refused.status_code == 503 and "tensors not written since" in refused.text, refused.text
            assert not ipc.admin.get("/health").json()["serving"]
            assert post("/reload_weights").status_code == 200
            assert _served_by_thread(ipc) == ipc.old
        assert ipc.admin.get("/get_model_info").json()["weight_version"] != "never"
        wait_for(lambda: not _shared_memory_of(trainer.pid), 10, "the dead trainer's files to go")
    finally:
        trainer.kill()
        trainer.wait(30)
        trainer.err_file.close()


def test_a_checkpoint_with_one_nan_is_refused_and_the_old_weights_serve(engine, tiny_model_path):
    """/reload_weights of a checkpoint with one NaN, its host copy not current (none was made since the start): the
    weights were written before the finite check found it, and come back from the copy the reload made first."""
    def poison(tensors):
        tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = math.nan

    folder = Path(tiny_model_path).parent / "one-nan"  # inside the allowed weights directory (the model's parent)
    shutil.rmtree(folder, ignore_errors=True)
    reply = engine.http.post("/reload_weights", json={"path": scaled_checkpoint(tiny_model_path, folder, poison)})
    assert reply.status_code == 400, reply.text
    assert "'model.layers.1.mlp.down_proj.weight' holds non-finite" in reply.json()["error"]["message"]
    assert engine.http.get("/health").json()["serving"] and _served(engine) == engine.old
    _alive(engine)
