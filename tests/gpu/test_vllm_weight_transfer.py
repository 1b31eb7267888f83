"""vLLM's four-phase weight transfer on CUDA (ipc backend): a trainer process sends what vLLM's own trainers send —
`ipc_handles_pickled` as a plain `pickle.dumps` of `{gpu uuid: reduce_tensor args}` (vLLM's newest form) and of
`{gpu uuid: (rebuild_cuda_tensor, args)}` (its earlier one, OpenRLHF's), and vLLM's packed chunk of one reused
buffer — into a `torpor serve` engine on the same GPU; the answers of the new weights, bit for bit; and with 2 GPUs
the nccl backend (trainer on GPU 1)."""

import json
import threading

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from trainer_process import start_trainer, stderr_of, tiny_checkpoints  # noqa: E402

from torpor.rl.engine_process import EngineProcess, free_port  # noqa: E402

SERVE = ["--device", "cuda", "--max-model-len", "256", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.2"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory.mktemp("weights"))


def served(engine) -> list:
    return [engine.post("/v1/completions", json={"prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                                                 "return_token_ids": True})["choices"][0]["token_ids"]
            for p in ([1, 2, 3, 4, 5], [9, 8, 7])]


VLLM_IPC_TRAINER = """
    import base64, json, pickle, sys, httpx, torch
    from torch.multiprocessing.reductions import reduce_tensor
    from torpor.engine.weights.loader import iter_checkpoint
    from torpor.rl.vllm_transfer import packed_ipc_update_infos
    url, token, path, form = sys.argv[1:5]
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120)
    named = [(n, t.cuda().contiguous()) for n, t in iter_checkpoint(path)]
    torch.cuda.synchronize()
    uuid = str(torch.cuda.get_device_properties(0).uuid)

    def post(route, body=None):
        r = http.post(route, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    post("/init_weight_transfer_engine", {"init_info": {}})
    post("/start_weight_update")
    if form == "packed":
        for info in packed_ipc_update_infos(named, buffer_bytes=256 << 10):
            post("/update_weights", {"update_info": info})
    else:  # what vLLM's IPC trainer posts: a plain pickle of the handles
        handles = [{uuid: reduce_tensor(t)[1] if form == "args" else reduce_tensor(t)} for _, t in named]
        post("/update_weights", {"update_info": {
            "names": [n for n, _ in named], "dtype_names": [str(t.dtype).split(".")[-1] for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode()}})
    print(json.dumps(post("/finish_weight_update", {"weight_version": form})), flush=True)
"""


@pytest.mark.parametrize("form", ["args", "function_and_args", "packed"])
def test_vllm_ipc_handles_from_another_process(checkpoints, form):
    with EngineProcess(checkpoints[1], SERVE) as reference:
        want = served(reference)
    with EngineProcess(checkpoints[0], [*SERVE, "--weight-transfer-config", '{"backend": "ipc"}']) as engine:
        before = served(engine)
        assert before != want
        trainer = start_trainer(VLLM_IPC_TRAINER, engine.url, engine.admin_token, checkpoints[1], form)
        out, _ = trainer.communicate(timeout=300)
        assert trainer.returncode == 0, stderr_of(trainer)
        assert json.loads(out) == {"message": "Weight update finished"}
        assert served(engine) == want
        assert engine.http.get("/get_model_info").json()["weight_version"] == form


NCCL_TRAINER = """
    import sys, threading, torch
    from torpor.engine.weights.loader import iter_checkpoint
    from torpor.rl.vllm_transfer import HTTPWeightTransferClient, send_weights, trainer_init
    url, token, path, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    torch.cuda.set_device(1)
    client = HTTPWeightTransferClient(url, token)
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    joining = threading.Thread(target=client.init_weight_transfer_engine, args=(init,))
    joining.start()
    group = trainer_init(init, "cuda:1")
    joining.join()
    named = [(n, t.to("cuda:1")) for n, t in iter_checkpoint(path)]
    for packed in (False, True):
        send_weights(client, named, group, packed=packed)
    print("done", flush=True)
"""


def test_nccl_four_phase_from_the_next_gpu(checkpoints):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    with EngineProcess(checkpoints[1], SERVE) as reference:
        want = served(reference)
    with EngineProcess(checkpoints[0], [*SERVE, "--weight-transfer-config", '{"backend": "nccl"}']) as engine:
        trainer = start_trainer(NCCL_TRAINER, engine.url, engine.admin_token, checkpoints[1], str(free_port()))
        timer = threading.Timer(300, trainer.kill)
        timer.start()
        out, _ = trainer.communicate()
        timer.cancel()
        assert trainer.returncode == 0 and out.strip() == "done", stderr_of(trainer)
        assert served(engine) == want
