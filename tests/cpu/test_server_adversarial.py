"""The server against bad and hostile input, over real HTTP against the tiny fp32 model on
CPU: bad checkpoints and paths for /reload_weights, non-finite logprobs, unknown fields, loose types,
SGLang's per-tag release, the messages a client gets, auth scope, 405's `Allow`. Each test failed on
the server before its fix."""

import json
import os
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors import safe_open
from server_thread import ServerThread, error_of, wait_for

from torpor.engine import LLM
from torpor.server import ServerConfig, build_app
from torpor.server.errors import json_text
from torpor.server.responses import ChatFormat

from .test_server import ENGINE

ADMIN = "admin-secret"
PROMPT = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def strict_json(text: str):
    """json.loads that refuses NaN / Infinity (what a strict client parser does)."""
    def refuse(constant):
        raise ValueError(f"invalid JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def weights_root(tiny_model_path, tmp_path_factory) -> Path:
    """The allowed weights directory: a copy of the tiny checkpoint (`good`) to serve and reload."""
    root = tmp_path_factory.mktemp("weights")
    shutil.copytree(tiny_model_path, root / "good")
    return Path(os.path.realpath(root))


@pytest.fixture(scope="module")
def server(weights_root):
    llm = LLM(str(weights_root / "good"), **ENGINE)
    config = ServerConfig("tiny", admin_token=ADMIN, max_tokens_cap=32)
    with ServerThread(build_app(llm.engine, config)) as url:
        admin = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {ADMIN}"})
        yield SimpleNamespace(url=url, llm=llm, http=httpx.Client(base_url=url, timeout=60), admin=admin)


@pytest.fixture(autouse=True)
def _serving_after_each_test(server):
    yield
    server.admin.post("/wake_up")
    if server.admin.get("/memory").json()["weights_discarded"]:
        server.admin.post("/reload_weights")


def greedy(server) -> dict:
    response = server.http.post("/v1/completions", json=PROMPT)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def sleeps(server) -> dict[str, float]:
    """torpor_sleeps_total by level."""
    return {s.labels["level"]: s.value for f in text_string_to_metric_families(server.http.get("/metrics").text)
            for s in f.samples if s.name == "torpor_sleeps_total"}


def copy_checkpoint(weights_root: Path, name: str) -> Path:
    folder = weights_root / name
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(weights_root / "good", folder)
    return folder


# ---- 11.6: a bad checkpoint file is the client's error --------------------------------------------
def _truncate(folder: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


def _empty(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"")


def _garbage_header(folder: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    (folder / "model.safetensors").write_bytes(data[:8] + b"\xff" * header_len + data[8 + header_len :])


def _index_naming_a_text_file(folder: Path) -> None:
    with safe_open(folder / "model.safetensors", "pt") as weights:
        names = list(weights.keys())
    (folder / "model.safetensors").unlink()
    (folder / "notes.txt").write_text("these are not weights\n" * 100)
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "notes.txt")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("damage", [_truncate, _empty, _garbage_header, _index_naming_a_text_file])
def test_bad_checkpoint_files_are_400_not_500(server, weights_root, damage):
    before = greedy(server)
    folder = copy_checkpoint(weights_root, f"bad-{damage.__name__}")
    damage(folder)
    error = error_of(server.admin.post("/reload_weights", json={"path": str(folder)}), 400)
    assert error["param"] == "path" and error["code"] == "invalid_checkpoint"
    assert "engine error" not in error["message"]
    server.admin.post("/reload_weights").raise_for_status()
    assert greedy(server) == before


# ---- 11.14: reload reads only inside the allowed weights directory --------------------------------
def test_reload_paths_outside_the_allowed_dir_are_403(server, weights_root, tiny_model_path, tmp_path):
    outside = [tiny_model_path, "/etc", "/nonexistent/folder", str(weights_root / ".." / "elsewhere"), "/"]
    (weights_root / "escape").unlink(missing_ok=True)
    (weights_root / "escape").symlink_to(tiny_model_path)  # a link inside that leads outside
    outside.append(str(weights_root / "escape"))
    messages = set()
    for path in outside:
        error = error_of(server.admin.post("/reload_weights", json={"path": path}), 403)
        assert error["code"] == "path_not_allowed" and error["param"] == "path"
        messages.add(error["message"])
    assert len(messages) == 1  # the same words whether the path exists or not
    # inside: a missing folder and a folder without weights get one generic answer
    (weights_root / "empty").mkdir(exist_ok=True)
    (weights_root / "a-file").write_text("x")
    answers = {error_of(server.admin.post("/reload_weights", json={"path": str(weights_root / name)}), 400)["message"]
               for name in ("missing", "empty", "a-file")}
    assert len(answers) == 1 and str(weights_root) not in answers.pop()
    # a link inside to a checkpoint inside is fine
    (weights_root / "alias").unlink(missing_ok=True)
    (weights_root / "alias").symlink_to(weights_root / "good")
    assert server.admin.post("/reload_weights", json={"path": str(weights_root / "alias")}).json()["serving"]


def test_checkpoint_files_linked_from_outside_are_403(server, weights_root, tmp_path):
    """A folder inside whose model.safetensors (or index) is a symlink to a file outside loaded that file."""
    outside = tmp_path / "outside"
    shutil.copytree(weights_root / "good", outside)
    index = {"metadata": {}, "weight_map": {"x": "model.safetensors"}}
    (outside / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in ("model.safetensors", "model.safetensors.index.json"):
        folder = weights_root / f"linked-{name}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        (folder / name).symlink_to(outside / name)
        error = error_of(server.admin.post("/reload_weights", json={"path": str(folder)}), 403)
        assert error["code"] == "path_not_allowed" and error["param"] == "path"
    sharded = weights_root / "linked-shard"  # an index inside, naming a shard that is a link to a file outside
    shutil.rmtree(sharded, ignore_errors=True)
    sharded.mkdir()
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"x": "model-00001-of-00001.safetensors"}}))
    (sharded / "model-00001-of-00001.safetensors").symlink_to(outside / "model.safetensors")
    error = error_of(server.admin.post("/reload_weights", json={"path": str(sharded)}), 403)
    assert error["code"] == "path_not_allowed"
    linked = weights_root / "linked-inside"  # a link to a file inside the allowed directory is fine
    shutil.rmtree(linked, ignore_errors=True)
    linked.mkdir()
    (linked / "model.safetensors").symlink_to(weights_root / "good" / "model.safetensors")
    assert server.admin.post("/reload_weights", json={"path": str(linked)}).json()["serving"]


def test_control_and_tokenize_errors_name_the_field(server):
    """A sleep level out of range, a reload path or a /tokenize text with a lone surrogate: 400s that named
    no field (the engine's or the codec's message)."""
    for level in (-1, 5, 2**70):
        error = error_of(server.admin.post("/sleep", params={"level": level}), 400)
        assert error["param"] == "level" and str(level) in error["message"]
    rpc = error_of(server.admin.post("/collective_rpc", json={"method": "sleep", "args": [9]}), 400)
    assert rpc["param"] == "level"

    def post(client: httpx.Client, path: str, body: dict) -> httpx.Response:  # ASCII JSON: "\\ud800" escaped
        return client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})

    assert error_of(post(server.admin, "/reload_weights", {"path": "/tmp/\ud800"}), 400)["param"] == "path"
    for body, param in (({"prompt": "a\ud800"}, "prompt"), ({"messages": [{"role": "user", "content": "\udfff"}]},
                                                            "messages.0.content")):
        error = error_of(post(server.http, "/tokenize", body), 400)
        assert error["param"] == param and error["code"] == "invalid_unicode", error
    assert not server.admin.get("/is_sleeping").json()["is_sleeping"]


def test_allowed_weights_dir_option(tmp_path, tiny_model_path, capsys):
    from torpor.cli.main import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--allowed-weights-dir" in capsys.readouterr().out
    with pytest.raises(ValueError, match="allowed_weights_dir"):
        ServerConfig("tiny", allowed_weights_dir="")


# ---- 11.7: never invalid JSON --------------------------------------------------------------------
def test_non_finite_logprobs_are_valid_json(server):
    norm = dict(server.llm.engine.executor.driver.runner.model.named_parameters())["model.norm.weight"]
    saved = norm.detach().clone()
    with torch.no_grad():
        norm.fill_(float("nan"))  # a fault: every logit and logprob is nan
    try:
        response = server.http.post("/v1/completions", json={**PROMPT, "logprobs": 2})
        assert response.status_code == 200, response.text
        logprobs = strict_json(response.text)["choices"][0]["logprobs"]
        assert logprobs["token_logprobs"] and set(logprobs["token_logprobs"]) == {-9999.0}
        chat = server.http.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2,
                                                               "temperature": 0})
        assert all(e["logprob"] == -9999.0 for e in strict_json(chat.text)["choices"][0]["logprobs"]["content"])
        events = server.http.post("/v1/completions", json={**PROMPT, "logprobs": 1, "stream": True}).text
        chunks = [strict_json(line[6:]) for line in events.splitlines() if line.startswith("data: {")]
        assert chunks and all(set(c["choices"][0]["logprobs"]["token_logprobs"]) <= {-9999.0} for c in chunks)
    finally:
        with torch.no_grad():
            norm.copy_(saved)
    assert strict_json(json_text({"a": [float("-inf"), float("inf"), float("nan"), 1.5]})) == {
        "a": [-9999.0, 9999.0, -9999.0, 1.5]}


# ---- 11.9: every option honoured or refused ------------------------------------------------------
@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"max_token": 5}, "max_token"),
    ("/v1/completions", {"stream": True, "stream_options": {"include_usage": True, "per_chunk": True}},
     "stream_options.per_chunk"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "returns": "x"}}],
                              "tool_choice": "none"}, "tools.0.function.returns"),
])
def test_unknown_fields_are_refused_by_name(server, path, extra, param):
    body = {**(PROMPT if "chat" not in path else CHAT), **extra}
    error = error_of(server.http.post(path, json=body), 400)
    assert error["param"] == param and error["code"] == "unsupported_parameter" and param in error["message"]


def test_harmless_and_null_fields_are_accepted(server):
    harmless = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "response_format": None}
    assert server.http.post("/v1/completions", json={**PROMPT, **harmless}).status_code == 200
    assert server.http.post("/v1/chat/completions", json={**CHAT, **harmless}).status_code == 200


# ---- 11.10: SGLang's per-tag release -------------------------------------------------------------
def test_release_memory_occupation_releases_only_the_named_tags(server):
    before, slept = greedy(server), sleeps(server).get("1", 0)
    nothing = server.admin.post("/release_memory_occupation", json={"tags": ["cuda_graph"]}).json()  # none on CPU
    assert (nothing["released"], nothing["level"], nothing["serving"]) == ([], None, True)
    released = server.admin.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).json()
    assert released["success"] and released["released"] == ["kv_cache"] and not released["serving"]
    tags = server.admin.get("/memory").json()["tags"]
    assert tags["kv_cache"]["state"] == "asleep"
    assert tags["weights"]["state"] == "awake" and tags["runtime"]["state"] == "awake"
    released = server.admin.post("/release_memory_occupation", json={"tags": ["weights", "cuda_graph"]}).json()
    assert released["released"] == ["weights"]  # no cuda_graph tag on CPU; kv_cache already released
    assert server.admin.get("/memory").json()["tags"]["weights"]["state"] == "asleep"
    assert sleeps(server)["1"] == slept + 1  # the first release slept the engine, the second changed no level
    resumed = server.admin.post("/resume_memory_occupation", json={"tags": ["weights"]}).json()
    assert resumed["woken"] == ["weights"] and not resumed["serving"]
    assert server.admin.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).json()["serving"]
    assert greedy(server) == before
    assert error_of(server.admin.post("/release_memory_occupation", json={"tags": ["gpu"]}), 400)["param"] == "tags"
    assert error_of(server.admin.post("/release_memory_occupation", json={"tags": [1]}), 400)


# ---- 11.11: strict types --------------------------------------------------------------------------
def test_loose_types_are_refused(server):
    error = error_of(server.http.post("/v1/completions", json={**PROMPT, "prompt": [True, False]}), 400)
    assert error["param"] == "prompt" and "true and false are not token ids" in error["message"]
    for field, value in [("max_tokens", True), ("logprobs", True), ("temperature", "0.5"), ("stream", 1)]:
        assert error_of(server.http.post("/v1/completions", json={**PROMPT, field: value}), 400)["param"] == field
    assert error_of(server.http.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": False}),
                    400)["param"] == "max_completion_tokens"
    error = error_of(server.admin.post("/collective_rpc", json={"method": "sleep", "args": [True]}), 400)
    assert error["param"] == "args.0" and "level" in error["message"]
    error = error_of(server.admin.post("/collective_rpc", json={"method": "sleep", "kwargs": {"level": True}}), 400)
    assert error["param"] == "kwargs.level"
    error = error_of(server.admin.post("/collective_rpc", json={"method": "sleep", "kwargs": {"lvl": 1}}), 400)
    assert error["param"] == "kwargs.lvl" and "'lvl'" in error["message"]
    assert "_sleep" not in error["message"] and "unexpected keyword" not in error["message"]
    error = error_of(server.admin.post("/collective_rpc", json={"method": "wake_up", "kwargs": {"tags": "weights"}}),
                     400)
    assert error["param"] == "kwargs.tags"
    assert error_of(server.admin.post("/collective_rpc", json={"method": "is_sleeping", "args": [1]}), 400)["param"] \
        == "args"
    assert error_of(server.admin.post("/collective_rpc", json={"method": "sleep", "args": [1], "kwargs": {"level": 1}}),
                    400)["param"] == "kwargs.level"
    assert not server.admin.get("/is_sleeping").json()["is_sleeping"]
    labels = {s.labels.get("level") for f in text_string_to_metric_families(server.http.get("/metrics").text)
              for s in f.samples if s.name == "torpor_sleeps_total"}
    assert "True" not in labels
    # positional arguments bind by the signature's order
    assert server.admin.post("/collective_rpc", json={"method": "sleep", "args": [0, "abort"]}).json()["results"][0][
        "is_sleeping"]


# ---- 11.12: messages that name the real problem ---------------------------------------------------
def test_messages_name_the_problem(server):
    error = error_of(server.http.post("/v1/completions"), 400)
    assert "None" not in error["message"] and "body" in error["message"]
    error = error_of(server.http.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 0}), 400)
    assert error["param"] == "max_completion_tokens" and "max_completion_tokens" in error["message"]
    error = error_of(server.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}), 400)
    assert error["param"] == "messages.0.content.0.text" and "null" in error["message"]
    for path, raw, param in [("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
                             ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\udfff"}]}',
                              "messages.0.content"),
                             ("/v1/completions", b'{"prompt": "a", "stop": ["\\ud83d"]}', "stop.0")]:
        error = error_of(server.http.post(path, content=raw, headers={"Content-Type": "application/json"}), 400)
        assert error["code"] == "invalid_unicode" and error["param"] == param and "unicode" in error["message"]
    # a lone surrogate in a field name; and one echoed back would still make a UTF-8 body of valid JSON
    response = server.http.post("/v1/completions", content=b'{"prompt": "a", "\\ud800": 1}',
                                headers={"Content-Type": "application/json"})
    assert error_of(response, 400)["code"] == "invalid_unicode"
    assert strict_json(json_text({"param": "\ud800"}).encode("utf-8").decode()) == {"param": "\ud800"}


def test_after_level_2_and_wake_the_request_is_told_to_reload(server):
    before = greedy(server)
    server.admin.post("/sleep", params={"level": 2}).raise_for_status()
    assert server.admin.post("/wake_up").json()["serving"] is False
    response = server.http.post("/v1/completions", json=PROMPT, headers={"X-Asleep-Timeout": "0.1"})
    error = error_of(response, 503)
    assert "/reload_weights" in error["message"] and error["code"] == "weights_discarded"
    server.admin.post("/sleep", params={"level": 1}).raise_for_status()
    error = error_of(server.http.post("/v1/completions", json=PROMPT, headers={"X-Asleep-Timeout": "0.1"}), 503)
    assert error["code"] == "engine_asleep"
    server.admin.post("/wake_up").raise_for_status()
    server.admin.post("/reload_weights").raise_for_status()
    assert greedy(server) == before


def test_chat_logprob_bytes_are_the_raw_bytes(server):
    tokenizer = server.llm.tokenizer
    fmt = ChatFormat(tokenizer, "tiny", "id", 1)
    for text, raw in [("Ã", b"\xc3"), ("Ġg", b" g")]:  # a lone UTF-8 lead byte; a space and a letter
        token_id = tokenizer._tokenizer.token_to_id(text)
        assert fmt._entry(token_id, -1.0)["bytes"] == list(raw)
    body = {**CHAT, "logprobs": True, "top_logprobs": 3, "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    for entry in server.http.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]:
        for item in [entry, *entry["top_logprobs"]]:
            token_id = tokenizer._tokenizer.token_to_id(item["token"])
            if token_id is not None and "\ufffd" not in item["token"]:
                assert bytes(item["bytes"]) == item["token"].encode()


def test_sleeps_total_counts_only_level_changes(server):
    before = sleeps(server)
    for level in (1, 1, 0, 2, 2, 1):  # changes: 1 and 2 only
        server.admin.post("/sleep", params={"level": level}).raise_for_status()
    after = sleeps(server)
    grown = {level: after.get(level, 0) - before.get(level, 0) for level in after}
    assert grown == {"1": 1, "2": 1, **({"0": 0} if "0" in after else {})}


# ---- auth scope and HTTP details ------------------------------------------------------------------
def test_is_sleeping_is_public_and_control_stays_guarded(server):
    assert server.http.get("/is_sleeping").json() == {"is_sleeping": False}
    for method, path in [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/memory"), ("POST", "/reload_weights"),
                         ("POST", "/collective_rpc"), ("POST", "/release_memory_occupation")]:
        assert error_of(server.http.request(method, path), 401)["code"] == "missing_token"


def test_405_carries_allow(server):
    response = server.http.get("/v1/completions")
    error_of(response, 405)
    assert response.headers["allow"] == "POST"
    response = server.http.delete("/is_sleeping")
    assert response.status_code == 405 and response.headers["allow"] == "GET"


def test_schema_says_400_not_422(server):
    schema = server.http.get("/openapi.json").json()
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            assert "422" not in operation["responses"] and "400" in operation["responses"], path
    ok = schema["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert "text/event-stream" in ok and "application/json" in ok
    assert list(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]


# ---- the asleep timeout also bounds a request queued before the sleep ---------------------------------
@pytest.fixture(scope="module")
def one_at_a_time(weights_root):
    """One running sequence at a time: a second request waits in the queue behind a long first one."""
    llm = LLM(str(weights_root / "good"), **{**ENGINE, "max_num_seqs": 1, "max_model_len": 1024})
    with ServerThread(build_app(llm.engine, ServerConfig("tiny", admin_token=ADMIN))) as url:
        admin = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {ADMIN}"})
        yield SimpleNamespace(http=httpx.Client(base_url=url, timeout=60), admin=admin)
        admin.post("/wake_up")


def queue_counts(server) -> tuple[float, float]:
    """(running, waiting) requests, from /metrics."""
    values = {s.name: s.value for f in text_string_to_metric_families(server.http.get("/metrics").text)
              for s in f.samples}
    return values["torpor_num_requests_running"], values["torpor_num_requests_waiting"]


def test_a_request_queued_before_a_sleep_gets_503_after_its_asleep_timeout(one_at_a_time):
    """X-Asleep-Timeout bounded only the wait of a request sent while asleep: one queued behind running work
    when a sleep came waited until the wake however long it took (forever without one)."""
    server = one_at_a_time
    long = {"prompt": [5, 6, 7], "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    short = {**long, "max_tokens": 4}
    bounded = {"x-asleep-timeout": "0.5"}

    def stream(headers: dict) -> list[str]:
        with server.http.stream("POST", "/v1/completions", json={**short, "stream": True}, headers=headers) as r:
            return [line for line in r.iter_lines() if line]

    with ThreadPoolExecutor(4) as pool:
        try:
            first = pool.submit(server.http.post, "/v1/completions", json=long)
            wait_for(lambda: queue_counts(server) == (1, 0), what="the long request to run")
            whole = pool.submit(server.http.post, "/v1/completions", json=short, headers=bounded)
            streamed = pool.submit(stream, bounded)
            unbounded = pool.submit(server.http.post, "/v1/completions", json=short)
            wait_for(lambda: queue_counts(server) == (1, 3), what="three requests queued behind it")
            server.admin.post("/sleep", params={"level": 1, "mode": "abort"}).raise_for_status()
            assert first.result(10).json()["choices"][0]["finish_reason"] == "abort"
            error = error_of(whole.result(10), 503)
            assert error["code"] == "engine_asleep" and "within 0.5 s" in error["message"]
            events = streamed.result(10)
            assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == "engine_asleep"
            assert queue_counts(server) == (0, 1)  # the two that gave up left the queue; the unbounded one waits
            assert not unbounded.done()
            server.admin.post("/wake_up").raise_for_status()
            assert unbounded.result(10).json()["choices"][0]["finish_reason"] == "length"
        finally:
            server.admin.post("/wake_up")  # a failure must not leave requests queued (pool exit waits)
