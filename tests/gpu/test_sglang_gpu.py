"""SGLang's RL loop on CUDA over HTTP, as an SGLang client drives it (tiny bf16 model, CUDA graphs): `/generate` answers
bit for bit what `LLM.generate` answers; release everything, resume the weights, one `/update_weights_from_tensor`
per flattened bucket from a trainer process (CUDA IPC, SGLang's payloads, the version on the last), resume the KV
cache: the new weights' answers bit for bit, `weight_version` in `meta_info` and `/get_model_info`, the tensor as
`/get_weights_by_name` reads it; `/update_weights_from_disk` back to the first checkpoint gives its answers again."""

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

ADMIN = "gpu-admin"
ENGINE = dict(device="cuda", max_model_len=256, max_num_seqs=8, block_size=16, num_kv_blocks=64)
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]
NEW_TOKENS = 16
TRAINER = """
    import sys, torch
    from torpor.engine.weights.loader import iter_checkpoint
    from torpor.rl import bucket_named_tensors, serialize
    named = [(n, t.cuda()) for n, t in iter_checkpoint(sys.argv[1])]
    buckets = list(bucket_named_tensors(named, 200_000))
    torch.cuda.synchronize()
    print(len(buckets), flush=True)
    for b in buckets:
        print(serialize(b.payload()), flush=True)
    print(named[0][0], flush=True)
    print(",".join(repr(float(v)) for v in named[0][1][:1].float().flatten()[:8].tolist()), flush=True)
    sys.stdin.readline()  # the engine has copied every bucket
"""


def reference(path: str) -> list[tuple[list[int], list[float]]]:
    llm = LLM(path, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    out = [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                            o.outputs[0].token_ids, strict=True)])
           for o in llm.generate(PROMPTS, params)]
    llm.close()
    return out


def generate(http) -> tuple[list, list]:
    body = {"input_ids": PROMPTS, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    answers = response.json()
    assert isinstance(answers, list) and len(answers) == len(PROMPTS)
    got = [(a["output_ids"], [entry[0] for entry in a["meta_info"]["output_token_logprobs"]]) for a in answers]
    for a, (ids, _) in zip(answers, got, strict=True):
        assert [entry[1] for entry in a["meta_info"]["output_token_logprobs"]] == ids
        assert a["meta_info"]["finish_reason"] == {"type": "length", "length": NEW_TOKENS}
    return got, [a["meta_info"]["weight_version"] for a in answers]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory.mktemp("sglang-gpu"))


def test_an_sglang_clients_rl_loop_on_cuda(checkpoints):
    want = {seed: reference(path) for seed, path in checkpoints.items()}
    assert want[0] != want[1]
    llm = LLM(checkpoints[0], **ENGINE)
    app = build_app(llm.engine, ServerConfig("tiny", admin_token=ADMIN))
    trainer = start_trainer(TRAINER, checkpoints[1])
    try:
        with ServerThread(app) as url, httpx.Client(base_url=url, timeout=60,
                                                    headers={"Authorization": f"Bearer {ADMIN}"}) as http:
            assert http.get("/health_generate").status_code == 200
            got, versions = generate(http)
            assert got == want[0]  # bit for bit: tokens and logprobs
            count = int(trainer.stdout.readline())
            payloads = [trainer.stdout.readline().strip() for _ in range(count)]
            name = trainer.stdout.readline().strip()
            values = [float(v) for v in trainer.stdout.readline().split(",")]
            assert count > 1 and all(payloads), stderr_of(trainer)

            assert http.post("/release_memory_occupation", json={}).json()["success"]
            assert http.post("/resume_memory_occupation", json={"tags": ["weights"]}).json()["success"]
            for i, payload in enumerate(payloads):
                body = {"serialized_named_tensors": [payload], "load_format": "flattened_bucket",
                        "flush_cache": i == count - 1}
                if i == count - 1:
                    body["weight_version"] = "step-1"
                answer = http.post("/update_weights_from_tensor", json=body)
                assert answer.status_code == 200 and answer.json()["success"], answer.text
            assert http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).json()["success"]
            trainer.stdin.write("done\n")
            trainer.stdin.flush()

            got, versions = generate(http)
            assert got == want[1] and versions == ["step-1"] * len(PROMPTS)
            assert http.get("/get_model_info").json()["weight_version"] == "step-1"
            read = http.post("/get_weights_by_name", json={"name": name, "truncate_size": 1})
            assert read.status_code == 200, read.text
            flat = torch.tensor(read.json()).flatten()[:len(values)].tolist()
            assert flat == pytest.approx(values, abs=0), (flat, values)

            answer = http.post("/update_weights_from_disk", json={"model_path": checkpoints[0],
                                                                  "weight_version": "base"})
            assert answer.status_code == 200 and answer.json()["success"], answer.text
            got, versions = generate(http)
            assert got == want[0] and versions == ["base"] * len(PROMPTS)
    finally:
        trainer.kill()
        trainer.wait()
        llm.close()
