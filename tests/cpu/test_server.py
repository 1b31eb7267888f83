"""`torpor.server` over real HTTP (uvicorn on 127.0.0.1 in a background thread, the tiny fp32 model on
CPU), driven by the official `openai` client and httpx: completions and chat (streaming and not),
logprobs, the control plane (sleep / wake / reload and their aliases), auth, limits, bad inputs,
metrics, an engine failure, and 64 concurrent requests after a wake."""

import asyncio
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import fastapi  # noqa: F401 - required by these tests
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_thread import ServerThread, error_of, wait_for

from torpor.engine import LLM, SamplingParams
from torpor.engine.tokenizer import Tokenizer
from torpor.server import ServerConfig, build_app

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=16, block_size=4)
ADMIN, API_KEY, MODEL = "admin-secret", "user-key", "tiny"
CAP, BODY_LIMIT = 64, 64 * 1024
GREEDY = dict(temperature=0, max_tokens=24, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tiny_model_path):
    """Admin token set, inference open, max_tokens cap 64, body limit 64 KiB."""
    llm = LLM(tiny_model_path, **ENGINE)
    config = ServerConfig(MODEL, admin_token=ADMIN, max_tokens_cap=CAP, max_body_bytes=BODY_LIMIT)
    with ServerThread(build_app(llm.engine, config)) as url:
        yield SimpleNamespace(
            url=url, llm=llm,
            client=openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60),
            http=httpx.Client(base_url=url, timeout=60),
            admin=httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {ADMIN}"}))


@pytest.fixture(scope="module")
def locked(tiny_model_path, tmp_path_factory):
    """API key required, no admin token (control plane off), a checkpoint without a chat template."""
    path = tmp_path_factory.mktemp("no-template") / "tiny"
    shutil.copytree(tiny_model_path, path)
    config_file = path / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    tokenizer_config.pop("chat_template", None)
    config_file.write_text(json.dumps(tokenizer_config))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    llm = LLM(str(path), **ENGINE)
    with ServerThread(build_app(llm.engine, ServerConfig(MODEL, api_key=API_KEY))) as url:
        yield SimpleNamespace(url=url, http=httpx.Client(base_url=url, timeout=60))


@pytest.fixture(autouse=True)
def _awake_after_each_test(request):
    """A failed test must not leave the shared server asleep (later tests would wait forever)."""
    yield
    if "server" in request.fixturenames:
        admin = request.getfixturevalue("server").admin
        admin.post("/wake_up")
        if admin.get("/memory").json()["weights_discarded"]:
            admin.post("/reload_weights")


def metrics(server) -> dict:
    """{(name, sorted label items): value} of one scrape."""
    text = server.http.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def num_waiting(server) -> float:
    return metrics(server)[("torpor_num_requests_waiting", ())]


def choice_of(completion) -> dict:
    return completion.choices[0].model_dump()


def complete(server, prompt="The quick brown fox", **kw):
    return server.client.completions.create(model=MODEL, prompt=prompt, **{**GREEDY, "logprobs": 2, **kw})


def stream_text(stream) -> tuple[str, str | None, int]:
    """Concatenated text, the finish reason, and the number of chunks with text or a finish reason."""
    text, finish, count = "", None, 0
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
        text += piece
        finish = choice.finish_reason or finish
        count += 1
    return text, finish, count


# ---- inference ----------------------------------------------------------------------------------
def test_models_and_health(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    assert server.http.get("/health").json() == {"status": "ok", "is_sleeping": False, "serving": True}


def test_streamed_completion_equals_non_streamed(server):
    whole = complete(server, logprobs=None)
    assert whole.usage.completion_tokens == 24 and whole.choices[0].finish_reason == "length"
    streamed, finish, _ = stream_text(complete(server, logprobs=None, stream=True))
    assert streamed == whole.choices[0].text and finish == "length"
    # A stop string: both forms end just before its first occurrence.
    text = whole.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = text[: text.index(stop)]
    stopped = complete(server, logprobs=None, stop=[stop, "never-seen"])
    assert stopped.choices[0].text == expected and stopped.choices[0].finish_reason == "stop"
    assert stream_text(complete(server, logprobs=None, stop=[stop], stream=True))[:2] == (expected, "stop")


def test_completion_logprobs(server):
    logprobs = complete(server, logprobs=3).choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 24
    offsets = [0, *(len(t) for t in logprobs.tokens)]  # tokens keep special tokens the text skips
    assert logprobs.text_offset == [sum(offsets[: i + 1]) for i in range(24)]
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and chosen <= 0
        assert chosen == max(top.values())  # greedy picks the most likely token
    streamed_logprobs = []
    for chunk in complete(server, logprobs=3, stream=True):
        streamed_logprobs += chunk.choices[0].logprobs.token_logprobs
    assert streamed_logprobs == logprobs.token_logprobs


def test_chat_completions(server, tiny_model_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    kw = dict(model=MODEL, messages=messages, temperature=0, max_tokens=16, extra_body={"ignore_eos": True})
    whole = server.client.chat.completions.create(logprobs=True, top_logprobs=2, **kw)
    prompt_ids = Tokenizer.from_pretrained(tiny_model_path).apply_chat_template(messages, tokenize=True)
    assert whole.usage.prompt_tokens == len(prompt_ids) and whole.usage.completion_tokens == 16
    assert whole.choices[0].message.role == "assistant"
    content = whole.choices[0].logprobs.content
    assert len(content) == 16 and all(bytes(c.bytes) == c.token.encode() for c in content)
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob == entry.top_logprobs[0].logprob
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    stream = server.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == 16
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    # the text of a seeded sampled request is reproducible
    sampled = [server.client.chat.completions.create(**{**kw, "temperature": 0.9, "seed": 11}) for _ in range(2)]
    assert sampled[0].choices[0].message.content == sampled[1].choices[0].message.content


# ---- sleep and wake -------------------------------------------------------------------------------
def test_request_sent_while_asleep_waits_and_is_answered_identically(server):
    # The sleep empties the prefix cache; "before" starts from an empty one too (a cache hit changes the
    # GEMM shapes of the prefill, hence the last bits of the logprobs: docs/engine.md, prefix caching).
    server.admin.post("/reset_prefix_cache").raise_for_status()
    before = choice_of(complete(server, temperature=0.8, seed=5))  # sampled, seeded, with logprobs
    slept = server.admin.post("/sleep", params={"level": 1}).json()
    assert slept["is_sleeping"] and not slept["serving"] and slept["report"]["bytes_released"] > 0
    assert server.admin.get("/is_sleeping").json() == {"is_sleeping": True}
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(complete, server, temperature=0.8, seed=5)
        wait_for(lambda: num_waiting(server) == 1, what="the request to queue")
        time.sleep(0.2)
        assert not waiting.done()
        woke = server.admin.post("/wake_up").json()
        assert set(woke["woken"]) >= {"weights", "kv_cache"} and woke["serving"] and not woke["is_sleeping"]
        assert choice_of(waiting.result(timeout=30)) == before
    assert server.http.get("/health").json()["is_sleeping"] is False


def test_selective_wake_serves_once_kv_cache_wakes(server):
    server.admin.post("/reset_prefix_cache").raise_for_status()  # the same (empty) cache as after the sleep
    before = choice_of(complete(server))
    server.admin.post("/sleep", params={"level": 1}).raise_for_status()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(complete, server)
        wait_for(lambda: num_waiting(server) == 1, what="the request to queue")
        woke = server.admin.post("/wake_up", params={"tags": ["weights"]}).json()
        assert "weights" in woke["woken"] and "kv_cache" not in woke["woken"] and not woke["serving"]
        memory = server.admin.get("/memory").json()
        assert memory["tags"]["weights"]["state"] == "awake" and memory["tags"]["kv_cache"]["state"] == "asleep"
        time.sleep(0.2)
        assert not waiting.done()
        woke = server.admin.post("/wake_up", params={"tags": ["kv_cache"]}).json()
        assert woke["woken"] == ["kv_cache"] and woke["serving"]
        assert choice_of(waiting.result(timeout=30)) == before


def test_level_2_then_reload_weights(server):
    server.admin.post("/reset_prefix_cache").raise_for_status()  # the same (empty) cache as after the sleep
    before = choice_of(complete(server))
    server.admin.post("/sleep", params={"level": 2}).raise_for_status()
    assert server.admin.get("/memory").json()["weights_discarded"] is True
    error = error_of(server.admin.post("/reload_weights"), 409)  # the weights are asleep
    assert "wake_up" in error["message"]
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(complete, server)
        woke = server.admin.post("/wake_up").json()
        assert not woke["is_sleeping"] and not woke["serving"]  # awake, but the weights are zeros
        wait_for(lambda: num_waiting(server) == 1, what="the request to queue")
        time.sleep(0.2)
        assert not waiting.done()
        reloaded = server.admin.post("/reload_weights", json={"path": server.llm.config.model}).json()
        assert reloaded["serving"]
        assert choice_of(waiting.result(timeout=30)) == before


def _stream_then_sleep(server, mode: str) -> tuple[int, str]:
    """A streamed request of CAP tokens; once its first chunk arrived, a level-1 sleep in `mode`. Returns
    the tokens generated (the usage chunk) and the request's finish reason."""
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": CAP, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    chunks, slept = [], None
    with ThreadPoolExecutor(1) as pool, server.http.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: "):]))
                if slept is None:  # the request is running: sleep now
                    slept = pool.submit(server.admin.post, "/sleep", params={"level": 1, "mode": mode})
        slept.result(timeout=30).raise_for_status()
    assert server.admin.get("/is_sleeping").json() == {"is_sleeping": True}
    server.admin.post("/wake_up").raise_for_status()
    finish_reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    return chunks[-1]["usage"]["completion_tokens"], finish_reasons[-1]


def test_sleep_waits_for_running_requests_or_aborts_them(server):
    assert _stream_then_sleep(server, "wait") == (CAP, "length")  # finished in full, then the engine slept
    num_tokens, finish_reason = _stream_then_sleep(server, "abort")
    assert finish_reason == "abort" and 1 <= num_tokens < CAP
    assert server.admin.post("/sleep", params={"level": 1, "mode": "later"}).status_code == 400


def test_rpc_and_memory_occupation_aliases(server):
    before = choice_of(complete(server))
    rpc = server.admin.post("/collective_rpc", json={"method": "sleep", "kwargs": {"level": 1}}).json()
    assert rpc["results"][0]["is_sleeping"]
    assert server.admin.post("/collective_rpc", json={"method": "is_sleeping"}).json() == {"results": [True]}
    rpc = server.admin.post("/collective_rpc", json={"method": "wake_up", "kwargs": {"tags": ["weights", "kv_cache"]}})
    assert rpc.json()["results"][0]["serving"]
    assert server.admin.post("/collective_rpc", json={"method": "reload_weights"}).json()["results"][0]["serving"]
    released = server.admin.post("/release_memory_occupation", json={"tags": ["weights", "kv_cache"]}).json()
    assert released["success"] and released["is_sleeping"] and released["level"] == 1
    assert server.admin.post("/resume_memory_occupation", json={"tags": ["weights"]}).json()["serving"] is False
    assert server.admin.post("/resume_memory_occupation").json()["serving"] is True
    assert choice_of(complete(server)) == before
    assert "sleep" in error_of(server.admin.post("/collective_rpc", json={"method": "rm -rf"}), 400)["message"]
    assert error_of(server.admin.post("/collective_rpc", json={"method": "sleep", "kwargs": {"depth": 3}}),
                    400)["param"] == "kwargs.depth"
    assert error_of(server.admin.post("/release_memory_occupation", json={"tags": ["gpu"]}), 400)["param"] == "tags"
    assert "level" in error_of(server.admin.post("/sleep", params={"level": 7}), 400)["message"]
    assert error_of(server.admin.post("/sleep", params={"mode": "later"}), 400)["param"] == "mode"
    assert error_of(server.admin.post("/wake_up", params={"tags": ["gpu"]}), 400)["param"] == "tags"
    assert not server.admin.get("/is_sleeping").json()["is_sleeping"]


def test_clients_that_give_up_while_asleep_leave_the_queue(server):
    server.admin.post("/sleep", params={"level": 1}).raise_for_status()
    body = {"prompt": "hi", "max_tokens": 8}
    with pytest.raises(httpx.ReadTimeout):
        server.http.post("/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    wait_for(lambda: num_waiting(server) == 0, what="the abandoned request to be aborted")
    with pytest.raises(httpx.ReadTimeout), server.http.stream(
            "POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
            timeout=httpx.Timeout(30, read=0.5)) as response:
        assert response.status_code == 200
        for _ in response.iter_lines():  # the opening chunk comes at once, then nothing while asleep
            pass
    wait_for(lambda: num_waiting(server) == 0, what="the abandoned stream to be aborted")
    assert server.admin.post("/wake_up").json()["serving"]


def test_asleep_timeout_gives_503(server):
    server.admin.post("/sleep", params={"level": 0}).raise_for_status()
    try:
        response = server.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                    headers={"X-Asleep-Timeout": "0.2"})
        assert error_of(response, 503)["code"] == "engine_asleep"
        response = server.http.post("/v1/completions", json={"prompt": "hi"}, headers={"X-Asleep-Timeout": "soon"})
        assert error_of(response, 400)["param"] == "x-asleep-timeout"
    finally:
        server.admin.post("/wake_up").raise_for_status()
    assert server.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                            headers={"X-Asleep-Timeout": "0"}).status_code == 200


def test_64_concurrent_mixed_requests_right_after_a_wake(server):
    import random

    rng = random.Random(0)
    jobs = [(rng.choice([1, 5, 20, 60]), rng.randint(1, 40), i % 3 == 0) for i in range(64)]

    async def one(client, prompt_len, max_tokens, stream):
        prompt = [rng.randrange(1000) for _ in range(prompt_len)]
        kw = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.7, seed=prompt_len,
                  extra_body={"ignore_eos": True})
        if not stream:
            result = await client.completions.create(**kw)
            return result.usage.completion_tokens, result.choices[0].finish_reason
        chunks = [c async for c in await client.completions.create(
            stream=True, stream_options={"include_usage": True}, **kw)]
        return chunks[-1].usage.completion_tokens, chunks[-2].choices[0].finish_reason

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        tasks = [asyncio.create_task(one(client, *job)) for job in jobs]
        await asyncio.to_thread(wait_for, lambda: num_waiting(server) == 64, 30, "64 queued requests")
        await asyncio.to_thread(server.admin.post, "/wake_up")
        return await asyncio.gather(*tasks)

    server.admin.post("/sleep", params={"level": 1}).raise_for_status()
    results = asyncio.run(main())
    assert results == [(max_tokens, "length") for _, max_tokens, _ in jobs]


# ---- errors, limits, auth -------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": CAP + 1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": list(range(1, 129))}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": list(range(1, 101)), "max_tokens": 40}, 400, "max_tokens"),  # not cut short
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**63}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": -(2**63) - 1}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 2000}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 99}, 400,
     "max_completion_tokens"),
])
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    assert error_of(server.http.post(path, json=body), status)["param"] == param


def test_malformed_and_oversize_bodies(server):
    response = server.http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert error_of(response, 400)["code"] == "invalid_json"
    huge = {"prompt": "x" * (BODY_LIMIT + 1)}
    assert error_of(server.http.post("/v1/completions", json=huge), 413)["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit applies to what arrives
        for _ in range(BODY_LIMIT // 1024 + 1):
            yield b" " * 1024

    response = server.http.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
    assert error_of(response, 413)["code"] == "request_too_large"
    assert error_of(server.http.get("/no/such/route"), 404)
    assert server.http.get("/health").status_code == 200


def test_control_plane_auth(server, locked):
    assert error_of(server.http.post("/sleep"), 401)["code"] == "missing_token"
    wrong = {"Authorization": "Bearer guess"}
    assert error_of(server.http.post("/sleep", headers=wrong), 403)["code"] == "invalid_admin_token"
    assert error_of(server.http.get("/memory", headers=wrong), 403)
    assert not server.admin.get("/is_sleeping").json()["is_sleeping"]
    # no admin token configured: every control endpoint is off and says how to turn it on
    for method, path in [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/memory"), ("POST", "/collective_rpc"),
                         ("POST", "/release_memory_occupation"), ("POST", "/reload_weights")]:
        error = error_of(locked.http.request(method, path, headers={"Authorization": f"Bearer {ADMIN}"}), 403)
        assert "--admin-token" in error["message"] and "TORPOR_ADMIN_TOKEN" in error["message"]


def test_api_key(locked):
    body = {"prompt": "hi", "max_tokens": 2}
    assert error_of(locked.http.post("/v1/completions", json=body), 401)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{locked.url}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{locked.url}/v1", api_key=API_KEY, max_retries=0)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    assert locked.http.get("/health").status_code == 200 and locked.http.get("/is_sleeping").status_code == 200
    # the metrics and the API's description are behind the key too (Prometheus sends a bearer token)
    key = {"Authorization": f"Bearer {API_KEY}"}
    for path in ("/metrics", "/openapi.json", "/docs", "/redoc"):
        assert error_of(locked.http.get(path), 401)["code"] == "invalid_api_key", path
        assert locked.http.get(path, headers=key).status_code == 200, path
    assert "torpor_http_requests_total" in locked.http.get("/metrics", headers=key).text
    assert "/v1/completions" in locked.http.get("/openapi.json", headers=key).json()["paths"]
    # this checkpoint has no chat template
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert raised.value.status_code == 400 and raised.value.body["code"] == "no_chat_template"


def test_engine_failure_is_a_500_and_the_server_goes_on(server, caplog):
    """The client gets a 500 that says where to look; the step's own error (torch's text, its build paths)
    goes to the server log only."""
    server.admin.post("/reset_prefix_cache").raise_for_status()  # both answers from an empty prefix cache
    before = choice_of(complete(server))
    runner = server.llm.engine.executor.driver.runner

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    runner.run = broken
    try:
        response = server.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        error = error_of(response, 500)
        assert "server log" in error["message"] and error["code"] == "engine_error"
        assert "injected fault" not in error["message"] and "injected fault" in caplog.text
        events = server.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True}).text
        assert '"code":"engine_error"' in events and events.endswith("data: [DONE]\n\n")
    finally:
        del runner.run
    server.admin.post("/reset_prefix_cache").raise_for_status()
    assert choice_of(complete(server)) == before


def test_metrics(server):
    before = metrics(server)
    for _ in range(3):
        complete(server)  # 24 output tokens each
    server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    server.http.post("/v1/completions", json={"prompt": "hi", "n": 0})
    server.admin.post("/sleep", params={"level": 1}).raise_for_status()
    asleep = metrics(server)
    server.admin.post("/wake_up").raise_for_status()
    after = metrics(server)

    def grew(name, *labels):
        key = (name, tuple(sorted(labels)))
        return after.get(key, 0) - before.get(key, 0)

    assert grew("torpor_http_requests_total", ("route", "/v1/completions"), ("status", "200")) == 3
    assert grew("torpor_http_requests_total", ("route", "/v1/completions"), ("status", "400")) == 1
    assert grew("torpor_http_requests_total", ("route", "/sleep"), ("status", "200")) == 1
    assert grew("torpor_generation_tokens_total") >= 3 * 24 + 1
    assert grew("torpor_prompt_tokens_total") >= 3 * 5
    assert grew("torpor_request_latency_seconds_count", ("endpoint", "completions")) == 3
    assert grew("torpor_request_latency_seconds_count", ("endpoint", "chat")) == 1
    assert grew("torpor_sleeps_total", ("level", "1")) == 1 and grew("torpor_sleep_seconds_count") == 1
    assert grew("torpor_wakes_total") == 1 and grew("torpor_wake_seconds_count") == 1
    for tag in ("weights", "kv_cache", "runtime"):
        reserved = after[("torpor_memory_bytes", (("kind", "reserved"), ("tag", tag)))]
        assert reserved > 0 and after[("torpor_memory_bytes", (("kind", "resident"), ("tag", tag)))] == reserved
        assert asleep[("torpor_memory_bytes", (("kind", "resident"), ("tag", tag)))] == 0
        assert (asleep[("torpor_tag_asleep", (("tag", tag),))], after[("torpor_tag_asleep", (("tag", tag),))]) == (1, 0)
    assert asleep[("torpor_memory_bytes", (("kind", "offloaded"), ("tag", "weights")))] > 0
    assert asleep[("torpor_memory_bytes", (("kind", "discarded"), ("tag", "kv_cache")))] > 0
    assert (asleep[("torpor_sleep_level", ())], after[("torpor_sleep_level", ())]) == (1, -1)
    assert (asleep[("torpor_serving", ())], after[("torpor_serving", ())]) == (0, 1)


def test_the_llm_front_end_refuses_while_the_server_drives_its_engine(tiny_model_path):
    """Two drivers of one engine would take each other's outputs (a flaky wrong answer once): while a server
    serves an LLM's engine the LLM refuses, naming the server; once the server stops it works again."""
    llm = LLM(tiny_model_path, **ENGINE)
    expected = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].text
    with ServerThread(build_app(llm.engine, ServerConfig(MODEL))) as url:
        for call in (lambda: llm.generate("Hello"), lambda: llm.sleep(1), lambda: llm.memory_usage()):
            with pytest.raises(RuntimeError, match="served by a running AsyncEngine"):
                call()
        served = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0},
                            timeout=60).json()
        assert served["choices"][0]["text"] == expected
    assert llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].text == expected


def test_the_prompts_of_one_completions_body_enter_the_same_engine_step(server, monkeypatch):
    """Every prompt of a batched /v1/completions body is queued by one command of the engine thread, so they are
    prefilled together. Added one by one, each prompt waited for an engine step (256 prompts of 8 tokens took 6.3 s
    on an H100, where a step takes ~25 ms)."""
    engine = server.llm.engine
    steps: list[int] = []
    real_step = engine.step

    def counted_step():
        outputs = real_step()
        steps.append(len(engine.scheduler.running))
        return outputs

    monkeypatch.setattr(engine, "step", counted_step)
    prompts = [[5 + i, 7, 9, 11] for i in range(16)]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    response = server.http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 16
    running = [n for n in steps if n]
    assert running and running[0] == 16, f"sequences running at each step: {steps} (the prompts trickled in)"
