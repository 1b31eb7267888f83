"""`n` and batches of prompts over real HTTP (the tiny fp32 model on CPU): choices indexed as OpenAI and vLLM
do (prompt index * n + sample index), streaming too, equal to `LLM.generate`; bad `n`; the prefix-cache
control endpoints and metrics."""

import json

import httpx
import pytest
from server_thread import ServerThread, error_of

from tests.cpu.test_server import ADMIN, MODEL, metrics
from torpor.engine import LLM, SamplingParams
from torpor.server import ServerConfig, build_app

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=16, block_size=4, max_n=4)
SEEDED = dict(temperature=1.0, seed=9, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tiny_model_path):
    llm = LLM(tiny_model_path, **ENGINE)
    reference = LLM(tiny_model_path, **ENGINE)  # its own engine: the server's thread alone drives the served one
    with ServerThread(build_app(llm.engine, ServerConfig(MODEL, admin_token=ADMIN))) as url:
        yield type("S", (), dict(llm=llm, reference=reference, http=httpx.Client(base_url=url, timeout=60),
                                 admin=httpx.Client(base_url=url, timeout=60,
                                                    headers={"Authorization": f"Bearer {ADMIN}"})))


def expected_texts(llm, prompts, n):
    outputs = llm.generate(prompts, SamplingParams(n=n, **SEEDED))
    return [c.text for o in outputs for c in o.outputs]


def stream(server, path, body) -> list[dict]:
    with server.http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completions_n_and_a_batch_of_prompts(server):
    prompts = ["def f(x):", "Hello there"]
    body = server.http.post("/v1/completions", json={"prompt": prompts, "n": 3, **SEEDED}).json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["text"] for c in body["choices"]] == expected_texts(server.reference, prompts, 3)
    assert len({c["text"] for c in body["choices"][:3]}) == 3  # the samples differ
    tokenizer = server.llm.tokenizer
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(p)) for p in prompts)
    assert body["usage"]["completion_tokens"] == 6 * 6
    ids = [tokenizer.encode(p) for p in prompts]  # a batch of token-id lists is the same batch
    by_ids = server.http.post("/v1/completions", json={"prompt": ids, "n": 3, **SEEDED}).json()
    assert [c["text"] for c in by_ids["choices"]] == [c["text"] for c in body["choices"]]


def test_streamed_n_equals_non_streamed(server):
    prompts = ["one", "two two"]
    whole = server.http.post("/v1/completions", json={"prompt": prompts, "n": 2, "logprobs": 1, **SEEDED}).json()
    chunks = stream(server, "/v1/completions", {"prompt": prompts, "n": 2, "logprobs": 1, **SEEDED,
                                                 "stream_options": {"include_usage": True}})
    texts, finish, tokens = {}, {}, {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        tokens.setdefault(choice["index"], []).extend(choice["logprobs"]["tokens"])
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    assert chunks[-1]["usage"] == whole["usage"]
    assert [texts[i] for i in range(4)] == [c["text"] for c in whole["choices"]]
    assert [tokens[i] for i in range(4)] == [c["logprobs"]["tokens"] for c in whole["choices"]]
    assert finish == {i: "length" for i in range(4)}


def test_chat_n_streaming_and_not(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, **SEEDED}
    whole = server.http.post("/v1/chat/completions", json=body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    chunks = stream(server, "/v1/chat/completions", body)
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0].get("delta", {}).get("role")]
    assert roles == [0, 1]
    texts = {0: "", 1: ""}
    for chunk in chunks:
        choice = chunk["choices"][0]
        texts[choice["index"]] += choice["delta"].get("content", "")
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in whole["choices"]]


@pytest.mark.parametrize("body", [{"prompt": "hi", "n": 0}, {"prompt": "hi", "n": 5}, {"prompt": "hi", "n": "x"},
                                  {"prompt": ["hi", "yo"], "n": 5}])
def test_bad_n_is_a_400_naming_n(server, body):
    assert error_of(server.http.post("/v1/completions", json=body), 400)["param"] == "n"
    assert server.llm.engine.is_finished()


def test_reset_prefix_cache_endpoints_and_metrics(server):
    prompt = list(range(10, 50))
    for _ in range(2):
        server.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).raise_for_status()
    assert server.http.post("/reset_prefix_cache").status_code == 401  # admin only
    for method, path in (("POST", "/reset_prefix_cache"), ("POST", "/flush_cache"), ("GET", "/flush_cache")):
        server.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).raise_for_status()
        assert server.llm.engine.scheduler.block_manager.num_cached_blocks > 0
        answer = server.admin.request(method, path)
        assert answer.status_code == 200
        if path == "/flush_cache":  # SGLang's text (idle: flushed)
            assert answer.text.startswith("Cache flushed.\n")
        else:
            assert answer.json() == {"success": True}
        assert server.llm.engine.scheduler.block_manager.num_cached_blocks == 0
    found = metrics(server)
    queries, hits = found[("torpor_prefix_cache_queries", ())], found[("torpor_prefix_cache_hits", ())]
    assert queries >= 80 and hits >= 36
    assert found[("torpor_prefix_cache_hit_rate", ())] == pytest.approx(hits / queries)
