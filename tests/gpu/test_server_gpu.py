"""The server on CUDA (tiny bf16 model, CUDA graphs): SGLang's per-tag `release_memory_occupation` frees
exactly the named tags' device memory, and the resumed engine answers bit-identically. Prints the bytes."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

import httpx  # noqa: E402
from server_thread import ServerThread  # noqa: E402

from torpor.engine import LLM  # noqa: E402
from torpor.server import ServerConfig, build_app  # noqa: E402
from torpor.synthetic import make_model  # noqa: E402

ADMIN = "gpu-admin"
MiB = 1 << 20
BODY = {"prompt": [5, 17, 300, 42], "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 3}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_model("tiny", tmp_path_factory.mktemp("server-gpu") / "tiny", dtype="bfloat16", progress=False)
    llm = LLM(str(path), device="cuda", max_model_len=256, max_num_seqs=16, block_size=16, num_kv_blocks=256)
    app = build_app(llm.engine, ServerConfig("tiny", admin_token=ADMIN))
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=60) as http, httpx.Client(
            base_url=url, timeout=60, headers={"Authorization": f"Bearer {ADMIN}"}) as admin:
        yield http, admin


def test_release_memory_occupation_frees_only_the_named_tags(server):
    http, admin = server
    before = http.post("/v1/completions", json=BODY).json()["choices"][0]
    memory = admin.get("/memory").json()
    reserved = {tag: usage["reserved_bytes"] for tag, usage in memory["tags"].items()}
    assert {"weights", "kv_cache", "cuda_graph"} <= set(reserved)
    used = memory["device_used_bytes"]
    print(f"\nawake: device used {used / MiB:.1f} MiB; reserved per tag (MiB): "
          + ", ".join(f"{t} {b / MiB:.1f}" for t, b in reserved.items()))
    released: list[str] = []
    for tag in ("kv_cache", "cuda_graph", "weights"):
        answer = admin.post("/release_memory_occupation", json={"tags": [tag]}).json()
        assert answer["released"] == [tag] and not answer["serving"]
        released.append(tag)
        memory = admin.get("/memory").json()
        states = {t: u["state"] for t, u in memory["tags"].items()}
        assert all(states[t] == ("asleep" if t in released else "awake") for t in states), states
        freed = used - memory["device_used_bytes"]
        expected = sum(reserved[t] for t in released)
        print(f"released {released}: device used {memory['device_used_bytes'] / MiB:.1f} MiB, freed "
              f"{freed / MiB:.1f} MiB of the tags' {expected / MiB:.1f} MiB")
        assert freed >= 0.9 * expected
    resumed = admin.post("/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}).json()
    assert not resumed["serving"]  # the weights still sleep
    assert admin.post("/resume_memory_occupation", json={"tags": ["weights"]}).json()["serving"]
    assert http.post("/v1/completions", json=BODY).json()["choices"][0] == before  # bit-identical
