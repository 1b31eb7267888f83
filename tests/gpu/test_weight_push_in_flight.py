"""Pushes with requests in flight on CUDA (torpor/server/weight_pipeline.py): a trainer process pushes CUDA IPC
buckets over HTTP with 2 requests in flight into a served engine. The requests staged off the engine thread open
their IPC handles and run the finite check on the staging thread's stream; the engine's copy waits for the event
recorded there. Checked: the answers of the pushed weights bit for bit, requests were staged, the trainer gets
every bucket's memory back, and a staged update that a sleep drops releases its IPC mapping unwritten."""

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

import httpx  # noqa: E402
from server_thread import ServerThread  # noqa: E402
from trainer_process import start_trainer, stderr_of, tiny_checkpoints  # noqa: E402

from torpor.engine import LLM, SamplingParams  # noqa: E402
from torpor.server import ServerConfig, build_app  # noqa: E402

ENGINE = dict(max_model_len=256, max_num_seqs=8, block_size=16, num_kv_blocks=64)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]
ADMIN = "admin-secret"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory.mktemp("weights"))


def answers(llm) -> list:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, GREEDY)]


TRAINER = """
    import json, sys, torch
    from torpor.engine.weights.loader import iter_checkpoint
    from torpor.rl import WeightPusher, bucket_named_tensors, serialize
    named = [(n, t.cuda()) for n, t in iter_checkpoint(sys.argv[1])]
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    if sys.argv[3] == "push":
        report = WeightPusher(sys.argv[2], {admin!r}, bucket_bytes=100_000, in_flight=2).push(named)
        print(json.dumps({{"requests": report.requests, "phases": sorted(report.engine_phases)}}), flush=True)
    else:  # one payload, held until the test says so
        bucket = next(iter(bucket_named_tensors(named, 100_000)))
        print(serialize(bucket.payload()), flush=True)
        sys.stdin.readline()
        del bucket
    torch.cuda.ipc_collect()  # blocks the engine still maps stay allocated here
    print(torch.cuda.memory_allocated() - baseline, flush=True)
"""


def _trainer(checkpoint: str, url: str, mode: str) -> subprocess.Popen:
    return start_trainer(TRAINER.format(admin=ADMIN), checkpoint, url, mode)


@pytest.fixture(scope="module")
def served(checkpoints):
    reference = LLM(checkpoints[1], device="cuda", **ENGINE)
    want = answers(reference)
    reference.close()
    del reference
    llm = LLM(checkpoints[0], device="cuda", **ENGINE)
    app = build_app(llm.engine, ServerConfig("tiny", admin_token=ADMIN))
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=120,
                                                headers={"Authorization": f"Bearer {ADMIN}"}) as admin:
        yield llm, url, admin, app.state.server, want


def test_a_push_in_flight_from_a_trainer_process(served, checkpoints):
    _, url, admin, _, want = served
    trainer = _trainer(checkpoints[1], url, "push")
    out, _ = trainer.communicate(timeout=300)
    assert trainer.returncode == 0, stderr_of(trainer)
    lines = out.strip().splitlines()
    report, left = json.loads(lines[0]), int(lines[1])
    assert report["requests"] > 2 and "stage" in report["phases"], report  # requests were staged off the thread
    assert left == 0, "the engine still maps the trainer's buckets after the push"
    r = admin.post("/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0,
                                            "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want[0][0]


def test_a_sleep_drops_a_staged_ipc_update_and_the_trainer_gets_its_memory(served, checkpoints):
    llm, url, admin, _, _ = served
    trainer = _trainer(checkpoints[1], url, "hold")
    try:
        payload = trainer.stdout.readline().strip()
        assert payload, stderr_of(trainer)
        receiver = llm.engine.weights
        with ThreadPoolExecutor(1) as pool:  # staged on another thread, as the server's staging thread does
            staged = pool.submit(receiver.stage, [payload], "flattened_bucket").result(60)
        assert staged.ready is not None and staged.pairs
        assert admin.post("/sleep", params={"level": 1}).status_code == 200
        assert staged.pairs == [] and staged.dropped
        assert admin.post("/wake_up").status_code == 200
        trainer.stdin.write("done\n")
        trainer.stdin.flush()
        left = int(trainer.stdout.readline())
    finally:
        trainer.stdin.close()
        trainer.wait(120)
    assert left == 0, "a dropped staged update still maps the trainer's bucket"
