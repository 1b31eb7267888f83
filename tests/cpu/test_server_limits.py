"""Bounded work on the open inference endpoints and strictness, over real HTTP (the tiny fp32 model on CPU):
prompts per request, text too long for the context refused by its length (no tokenizing), the event loop
free while clients flood it with 1 MB prompts, no asyncio error when a client goes away, strict types on
/tokenize and /detokenize, HEAD /health, and error texts that name no internals."""

import gc
import statistics
import threading
import time

import httpx
import pytest
from server_thread import ServerThread, error_of, wait_for

from torpor.engine import LLM
from torpor.server import ServerConfig, build_app

from .test_server import ENGINE

ADMIN = "admin"


@pytest.fixture(scope="module")
def limited(tiny_model_path):
    llm = LLM(tiny_model_path, **ENGINE)
    config = ServerConfig("tiny", admin_token=ADMIN, max_prompts_per_request=3)
    with ServerThread(build_app(llm.engine, config)) as url:
        admin = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {ADMIN}"})
        yield httpx.Client(base_url=url, timeout=60), admin, llm.get_tokenizer()
        admin.post("/wake_up")


def test_prompts_per_request_are_bounded(limited):
    http, _, _ = limited
    assert http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 1}).status_code == 200
    for path, body, param in (("/v1/completions", {"prompt": ["a", "b", "c", "d"]}, "prompt"),
                              ("/v1/completions", {"prompt": [[5], [6], [7], [8]]}, "prompt"),
                              ("/generate", {"text": ["a"] * 4}, "text"),
                              ("/generate", {"input_ids": [[5]] * 4}, "input_ids")):
        error = error_of(http.post(path, json={**body, "max_tokens": 1} if "prompt" in body else body), 400)
        assert error["param"] == param and error["code"] == "too_many_prompts"
        assert "--max-prompts-per-request" in error["message"] and "4 prompts" in error["message"]


def test_text_too_long_for_the_context_is_refused_by_its_length(limited):
    http, _, tokenizer = limited
    bound = 128 * tokenizer.max_chars_per_token  # max_model_len x the longest token (no normalizer here)
    for path, body, param in (("/v1/completions", {"prompt": "x" * (bound + 1)}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * bound}]},
                               "messages"),
                              ("/tokenize", {"prompt": "x" * (bound + 1)}, "prompt"),
                              ("/generate", {"text": "x" * (bound + 1)}, "text")):
        error = error_of(http.post(path, json=body), 400)
        assert error["param"] == param and error["code"] == "context_length_exceeded", error
        assert f"at most {bound} characters" in error["message"]
    within = http.post("/tokenize", json={"prompt": "x" * bound}).json()  # at the bound: tokenized
    assert within["count"] == len(tokenizer.encode("x" * bound))


def test_a_flood_of_long_prompts_leaves_the_event_loop_free(limited):
    """Four clients post 1 MB prompts (refused: too long) as fast as they are answered; meanwhile /health and
    a 1-token completion answer in milliseconds. Tokenizing each on the event loop took ~1.7 s: /health then
    waited seconds and the completion's p50 went from ~8 ms to ~7 s (scripts/bench_prompt_flood.py)."""
    http, _, _ = limited
    url = str(http.base_url)
    prompt = "hello world " * ((1 << 20) // 12 - 8)  # a body just under the 1 MiB limit
    stop, refused = threading.Event(), []

    def flood() -> None:
        with httpx.Client(base_url=url, timeout=120) as client:
            while not stop.is_set():
                refused.append(client.post("/v1/completions", json={"prompt": prompt}).status_code)

    clients = [threading.Thread(target=flood, daemon=True) for _ in range(4)]
    for client in clients:
        client.start()
    try:
        wait_for(lambda: len(refused) >= 4, what="the flood to start")
        health, completions = [], []
        for _ in range(10):
            start = time.perf_counter()
            http.get("/health").raise_for_status()
            health.append(time.perf_counter() - start)
            start = time.perf_counter()
            http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).raise_for_status()
            completions.append(time.perf_counter() - start)
    finally:
        stop.set()
        for client in clients:
            client.join(60)
    assert set(refused) == {400} and len(refused) >= 8
    assert statistics.median(health) < 0.5 and statistics.median(completions) < 0.5, (health, completions)


def test_a_client_that_goes_away_leaves_no_asyncio_error(limited, caplog):
    """A disconnect used to cancel an asyncio.gather whose CancelledError nobody retrieved: asyncio logged
    '_GatheringFuture exception was never retrieved' (an ERROR traceback) for every client that left."""
    http, admin, _ = limited
    caplog.set_level("ERROR", logger="asyncio")
    with pytest.raises(httpx.ReadTimeout):  # running: a generation of 120 steps (~0.4 s), left after 0.05 s
        http.post("/v1/completions", json={"prompt": [[5] * 3, [6] * 3], "max_tokens": 120, "ignore_eos": True,
                                           "n": 2}, timeout=httpx.Timeout(30, read=0.05))
    admin.post("/sleep", params={"level": 0}).raise_for_status()
    try:
        with pytest.raises(httpx.ReadTimeout):  # queued behind a sleep, then the client gives up
            http.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 4},
                      timeout=httpx.Timeout(30, read=0.3))
        wait_for(lambda: admin.get("/metrics").text.count("torpor_num_requests_waiting 0.0") == 1,
                 what="the abandoned requests to be aborted")
    finally:
        admin.post("/wake_up").raise_for_status()
    wait_for(lambda: http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200,
             what="the server to answer again")
    gc.collect()  # asyncio logs an unretrieved exception when its future is collected
    time.sleep(0.1)
    gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()], caplog.text


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/detokenize", {"tokens": [True]}, "tokens.0"),
    ("/detokenize", {"tokens": ["5"]}, "tokens.0"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "hi", "return_token_strs": 1}, "return_token_strs"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": "no"},
     "add_generation_prompt"),
])
def test_tokenize_types_are_strict(limited, path, body, param):
    http, _, _ = limited
    assert error_of(http.post(path, json=body), 400)["param"] == param


def test_head_health(limited):
    http, _, _ = limited
    head = http.head("/health")
    assert head.status_code == 200 and head.content == b""
    assert http.get("/health").json()["status"] == "ok"


def test_error_texts_name_no_internals(limited):
    http, _, _ = limited
    messages = [{"role": "user", "content": "hi"}]
    for path, body in (("/v1/chat/completions", {"messages": messages, "chat_template_kwargs": {"template": "x"}}),
                       ("/tokenize", {"messages": messages, "chat_template_kwargs": {"template": "x"}})):
        error = error_of(http.post(path, json=body), 400)
        assert error["param"] == "chat_template_kwargs" and "render_chat" not in error["message"]
        assert "()" not in error["message"] and ".py" not in error["message"]
