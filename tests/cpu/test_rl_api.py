"""The pause / resume / abort and weight-label routes over real HTTP (uvicorn in a thread, the tiny fp32 model on
CPU), vLLM's and SGLang's bodies and answers, and the weights' labels per output token across a trainer process's
push during a "keep" pause; SGLang's flush_cache and its strict memory-occupation tags."""

import json
import threading
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_thread import ServerThread, error_of, wait_for
from trainer_process import start_trainer, stderr_of

from torpor.engine import LLM, SamplingParams
from torpor.engine.weights.loader import iter_checkpoint
from torpor.rl import serialize
from torpor.server import ServerConfig, build_app
from torpor.synthetic import make_model

ENGINE = dict(device="cpu", dtype="float32", max_model_len=512, max_num_seqs=8, block_size=4)
MODEL, ADMIN = "tiny", "rl-admin"
PROMPT = [5, 6, 7, 8, 9, 10]
LONG = 400  # output tokens: a pause comes long before the end
PUSH = """
    import sys
    import httpx
    from torpor.engine.weights.loader import iter_checkpoint
    from torpor.rl import serialize

    url, token, path, version = sys.argv[1:]
    body = {"serialized_named_tensors": [serialize(list(iter_checkpoint(path)))], "weight_version": version}
    answer = httpx.post(url + "/update_weights_from_tensor", json=body, timeout=120,
                        headers={"Authorization": "Bearer " + token})
    print(answer.status_code, answer.json()["message"])
"""


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory) -> str:
    return str(make_model("tiny", tmp_path_factory.mktemp("tiny-seed4") / "tiny", seed=4, dtype="float32",
                          progress=False))


@pytest.fixture(scope="module")
def server(tiny_model_path):
    llm = LLM(tiny_model_path, **ENGINE)
    app = build_app(llm.engine, ServerConfig(MODEL, admin_token=ADMIN))
    with ServerThread(app) as url:
        admin = httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {ADMIN}"})
        yield SimpleNamespace(url=url, admin=admin, llm=llm, path=tiny_model_path)


@pytest.fixture(autouse=True)
def _idle_after_each_test(server):
    yield
    server.admin.post("/resume").raise_for_status()
    server.admin.post("/wake_up").raise_for_status()
    server.admin.post("/abort_requests", json={}).raise_for_status()
    if server.admin.get("/weight_info").json()["weight_version"] != "default":
        push(server, server.path, "default")
    wait_for(lambda: server.llm.engine.is_finished(), what="the requests to end")


@pytest.fixture(scope="module")
def old_tokens(tiny_model_path) -> list[int]:
    return LLM(tiny_model_path, **ENGINE).generate([PROMPT], greedy(LONG), use_tqdm=False)[0].outputs[0].token_ids


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def push(server, path: str, version: str | None = None, **fields) -> httpx.Response:
    """In this process (the trainer's protocol: a shared-memory payload)."""
    body = {"serialized_named_tensors": [serialize(list(iter_checkpoint(path)))], "weight_version": version, **fields}
    return server.admin.post("/update_weights_from_tensor", json=body)


class Stream:
    """A streamed generation read on a thread of its own: its chunks as they come."""

    def __init__(self, server, path: str = "/v1/completions", **body) -> None:
        defaults = {"model": MODEL, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True} if path == "/v1/completions" else {}
        self.chunks, self.done = [], False
        self.thread = threading.Thread(target=self._read, args=(server.url, path, {**defaults, **body}), daemon=True)
        self.thread.start()

    def _read(self, url: str, path: str, body: dict) -> None:
        with httpx.Client(base_url=url, timeout=120) as http, http.stream("POST", path, json={**body,
                                                                                               "stream": True}) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    self.chunks.append(json.loads(line.removeprefix("data: ")))

    def tokens(self) -> list[int]:
        return [t for chunk in list(self.chunks) for t in chunk["choices"][0].get("token_ids") or []]

    def started(self, num_tokens: int = 2) -> "Stream":
        wait_for(lambda: len(self.tokens()) >= num_tokens, what="the stream's first tokens")
        return self

    def join(self) -> dict:
        """The last chunk's choice, once the stream ended."""
        self.thread.join(60)
        assert self.done, self.chunks[-1:]
        return self.chunks[-1]["choices"][0]


def metrics(server) -> dict:
    text = server.admin.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def complete_in_thread(server, max_tokens: int = 4) -> dict:
    """A completion sent from a thread; `result` holds its answer once it came."""
    result: dict = {}

    def send() -> None:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            result["answer"] = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                                  "max_tokens": max_tokens, "temperature": 0})
    result["thread"] = threading.Thread(target=send, daemon=True)
    result["thread"].start()
    return result


def test_pause_abort_ends_streams_with_a_last_chunk_and_requests_wait_for_the_resume(server):
    stream = Stream(server).started()
    assert server.admin.post("/pause").json() == {"status": "paused"}  # vLLM's default mode: abort
    last = stream.join()
    tokens = stream.tokens()
    assert last["finish_reason"] == "abort" and 2 <= len(tokens) < LONG
    assert last["weight_versions"] == [{"version": "default", "start": 0, "end": len(tokens)}]
    assert all(chunk["choices"][0]["weight_versions"] is None for chunk in stream.chunks[:-1])
    assert server.admin.get("/is_paused").json() == {"is_paused": True}
    found = metrics(server)
    assert (found[("torpor_generation_paused", (("scope", "new"),))],
            found[("torpor_generation_paused", (("scope", "all"),))]) == (1, 0)
    waiting = complete_in_thread(server)
    impatient = httpx.post(f"{server.url}/v1/completions", headers={"x-asleep-timeout": "0.2"},
                           json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert error_of(impatient, 503)["code"] == "generation_paused"  # the asleep timeout applies to a pause
    assert "answer" not in waiting  # without a timeout it waits for the resume
    assert server.admin.post("/resume").json() == {"status": "resumed"}
    waiting["thread"].join(60)
    choice = waiting["answer"].json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["weight_versions"][0]["end"] == 4
    assert server.admin.get("/is_paused").json() == {"is_paused": False}


def test_pause_wait_returns_once_the_running_finished(server):
    stream = Stream(server, max_tokens=60).started()
    assert server.admin.post("/pause", params={"mode": "wait"}).json() == {"status": "paused"}
    assert server.llm.engine.is_finished()  # the running request finished before the answer
    assert stream.join()["finish_reason"] == "length" and len(stream.tokens()) == 60
    stream = Stream(server, max_tokens=8)  # waits for the resume
    server.admin.post("/resume").raise_for_status()
    assert stream.join()["finish_reason"] == "length"
    deprecated = Stream(server, max_tokens=30).started()  # vLLM's deprecated flag means mode "wait"
    assert server.admin.post("/pause", params={"wait_for_inflight_requests": True}).status_code == 200
    assert deprecated.join()["finish_reason"] == "length"


def test_pause_errors_in_vllm_shape(server):
    answer = server.admin.post("/pause", params={"mode": "retract"})  # SGLang's mode, not vLLM's
    assert answer.status_code == 400 and "Invalid pause mode: retract" in answer.json()["error"]
    answer = server.admin.post("/pause", params={"mode": "wait", "timeout": -1})
    assert answer.status_code == 400 and "timeout" in answer.json()["error"]
    server.admin.post("/sleep", params={"level": 0, "mode": "keep"}).raise_for_status()
    stream = Stream(server)
    server.admin.post("/wake_up", params={"tags": "scheduling"}).raise_for_status()
    stream.started()
    server.admin.post("/sleep", params={"level": 0, "mode": "keep"}).raise_for_status()  # frozen
    answer = server.admin.post("/pause", params={"mode": "wait"})
    assert answer.status_code == 500 and "cannot finish" in answer.json()["error"]
    assert server.admin.get("/is_paused").json() == {"is_paused": False}  # nothing changed
    error_of(server.admin.post("/sleep", params={"level": 1, "mode": "wait"}), 409)
    server.admin.post("/wake_up", params={"tags": "scheduling"}).raise_for_status()
    assert stream.join()["finish_reason"] == "length"  # kept through the level-0 sleep
    anonymous = httpx.Client(base_url=server.url)
    assert error_of(anonymous.post("/pause"), 401)["code"] == "missing_token"
    assert error_of(anonymous.get("/is_paused"), 401)


def test_a_wait_that_cannot_end_answers_and_undoes_its_pause(server):
    stream = Stream(server).started()
    answer = server.admin.post("/pause", params={"mode": "wait", "timeout": 0.05})  # torpor's bound
    assert answer.status_code == 500 and "still ran after 0.05 s; the pause is undone" in answer.json()["error"]
    assert server.admin.get("/is_paused").json() == {"is_paused": False} and not stream.done
    waiting: dict = {}
    thread = threading.Thread(target=lambda: waiting.update(answer=server.admin.post("/pause",
                                                                                      params={"mode": "wait"})))
    thread.start()
    wait_for(lambda: server.llm.engine.is_paused(), what="the wait to begin")
    assert server.admin.post("/pause", params={"mode": "keep", "clear_cache": False}).status_code == 200
    thread.join(60)  # the requests it waits for are frozen by the second pause: it answers, not hangs
    assert waiting["answer"].status_code == 500 and "cannot finish" in waiting["answer"].json()["error"]
    assert server.llm.engine.state().paused == "all"  # the second pause stands
    server.admin.post("/resume").raise_for_status()
    assert stream.join()["finish_reason"] == "length"


def test_keep_pause_across_a_trainer_push_span_by_span(server, new_weights, old_tokens):
    """vLLM's in-flight update: paused with "keep" (clear_cache: the KV is recomputed), new weights and their label
    pushed by a trainer process, resumed: the tokens before the update are the old weights' answer, those after it
    the new weights' continuation of the same tokens."""
    stream = Stream(server).started()
    assert server.admin.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    found = metrics(server)
    assert found[("torpor_generation_paused", (("scope", "all"),))] == 1
    trainer = start_trainer(PUSH, server.url, ADMIN, new_weights, "step-1")
    out, _ = trainer.communicate(timeout=120)
    assert trainer.returncode == 0, stderr_of(trainer)
    assert out.startswith("200") and "Weight version updated to step-1." in out
    assert server.admin.get("/weight_info").json() == {"weight_version": "step-1"}
    server.admin.post("/resume").raise_for_status()
    last = stream.join()
    tokens = stream.tokens()
    k = last["weight_versions"][0]["end"]
    assert last["weight_versions"] == [{"version": "default", "start": 0, "end": k},
                                       {"version": "step-1", "start": k, "end": LONG}]
    assert 2 <= k < LONG and tokens[:k] == old_tokens[:k]
    continued = LLM(new_weights, **ENGINE).generate([PROMPT + tokens[:k]], greedy(LONG - k), use_tqdm=False)
    assert tokens[k:] == continued[0].outputs[0].token_ids


def test_update_endpoints_set_the_version_only_on_success_and_abort_first(server, tiny_model_path):
    named = list(iter_checkpoint(tiny_model_path))
    wrong = [(named[0][0], named[0][1][:-1]), *named[1:]]
    answer = server.admin.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [serialize(wrong)], "weight_version": "never"})
    assert answer.status_code == 400
    assert server.admin.get("/weight_info").json() == {"weight_version": "default"}
    assert error_of(push(server, tiny_model_path, ""), 400)["param"] == "weight_version"
    stream = Stream(server).started()
    answer = push(server, tiny_model_path, "v2", abort_all_requests=True).json()
    assert answer["success"] and answer["message"].endswith("Weight version updated to v2.")
    assert stream.join()["finish_reason"] == "abort"  # aborted before the update
    assert stream.join()["weight_versions"][0]["version"] == "default"
    server.admin.get("/get_model_info").raise_for_status()
    assert server.admin.get("/get_model_info").json()["weight_version"] == "v2"


def test_update_weight_version_serves_both_peers(server):
    stream = Stream(server).started()
    vllm = server.admin.post("/update_weight_version", json={"new_version": "v8"}).json()  # vLLM's body
    assert vllm == {"success": True, "message": "Weight version updated to v8", "new_version": "v8"}
    sglang = server.admin.post("/update_weight_version", json={"new_version": "v9", "abort_all_requests": True})
    assert sglang.json()["new_version"] == "v9" and server.admin.get("/weight_info").json()["weight_version"] == "v9"
    last = stream.join()
    assert last["finish_reason"] == "abort"
    assert [span["version"] for span in last["weight_versions"]][-1] == "v8"  # labelled between two steps
    assert error_of(server.admin.post("/update_weight_version", json={"new_version": ""}), 400)["param"] == \
        "new_version"
    assert error_of(server.admin.post("/update_weight_version", json={}), 400)["param"] == "new_version"
    assert server.admin.get("/get_world_size").json() == {"world_size": 1}
    assert server.admin.get("/get_world_size", params={"include_dp": False}).json() == {"world_size": 1}


def test_abort_requests_by_id_and_all_without_pausing(server):
    first, second = Stream(server).started(), Stream(server).started()
    answer = server.admin.post("/abort_requests", json={"request_ids": [first.chunks[0]["id"], "no-such-id"]})
    assert answer.json() == {"status": "aborted", "aborted": 1}
    assert first.join()["finish_reason"] == "abort"
    assert not second.done and server.admin.get("/is_paused").json() == {"is_paused": False}
    assert server.admin.post("/abort_requests", json={}).json() == {"status": "aborted", "aborted": 1}
    assert second.join()["finish_reason"] == "abort"
    chat = Stream(server, "/v1/chat/completions", model=MODEL, messages=[{"role": "user", "content": "hi"}],
                  max_tokens=LONG, temperature=0, ignore_eos=True, return_token_ids=True).started()
    assert server.admin.post("/abort_requests").json() == {"status": "aborted", "aborted": 1}  # no body: all
    last = chat.join()
    assert last["finish_reason"] == "abort" and last["weight_versions"][0]["end"] == len(chat.tokens())
    assert error_of(server.admin.post("/abort_requests", json={"request_ids": [3]}), 400)


def sglang_stream(server, rid: str) -> Stream:
    return Stream(server, "/generate", input_ids=PROMPT, rid=rid,
                  sampling_params={"max_new_tokens": LONG, "temperature": 0, "ignore_eos": True})


def sglang_tokens(stream: Stream) -> int:
    return len(stream.chunks[-1]["output_ids"]) if stream.chunks else 0


def test_sglang_pause_continue_and_abort_request(server):
    stream = sglang_stream(server, "job-1")
    wait_for(lambda: sglang_tokens(stream) >= 2, what="tokens")
    answer = server.admin.post("/pause_generation", json={"mode": "in_place"}).json()
    assert answer == {"message": "Generation paused successfully.", "status": "ok"}
    (seq,) = server.llm.engine.scheduler.running  # frozen with its KV
    frozen = seq.num_output_tokens
    busy = server.admin.get("/flush_cache")
    assert busy.status_code == 400 and busy.text.startswith("Cache not flushed because there are pending requests.")
    assert server.admin.post("/flush_cache", params={"timeout": 0.05}).status_code == 400  # waited, still busy
    assert seq.num_output_tokens == frozen and seq.block_table
    answer = server.admin.post("/continue_generation", json={"torch_empty_cache": True}).json()
    assert answer == {"message": "Generation continued successfully.", "status": "ok"}
    assert server.admin.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    found = metrics(server)
    assert (found[("torpor_num_requests_running", ())], found[("torpor_num_requests_waiting", ())]) == (0, 1)
    server.admin.post("/continue_generation").raise_for_status()
    assert server.admin.post("/abort_request", json={"rid": ""}).content == b""  # an empty rid: nothing
    other = sglang_stream(server, "job-2")
    wait_for(lambda: sglang_tokens(other) >= 1, what="tokens")
    assert server.admin.post("/abort_request", json={"rid": "job-"}).status_code == 200  # a prefix: both
    for ended in (stream, other):
        ended.thread.join(60)
        meta = ended.chunks[-1]["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["weight_versions"][0]["version"] == "default"
    assert server.admin.post("/pause_generation", json={"mode": "keep"}).status_code == 400  # vLLM's name
    assert server.admin.post("/pause_generation").status_code == 200  # SGLang's default: abort
    assert server.admin.post("/abort_request", json={"abort_all": True}).status_code == 200


def test_flush_cache_waits_for_the_requests_up_to_its_timeout(server):
    stream = Stream(server, max_tokens=120).started()
    flushed = server.admin.post("/flush_cache", params={"timeout": 60})
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.\n")
    assert stream.done or stream.join()["finish_reason"] == "length"  # it waited for the request to end
    assert server.llm.engine.scheduler.block_manager.num_cached_blocks == 0
    assert error_of(server.admin.get("/flush_cache", params={"timeout": "inf"}), 400)["param"] == "timeout"
    stream = Stream(server).started()
    reset = server.admin.post("/reset_prefix_cache", params={"reset_running_requests": True, "reset_external": True})
    assert reset.json() == {"success": True}  # vLLM's: always done (the running request recomputes)
    assert server.admin.post("/abort_requests", json={}).status_code == 200
    assert stream.join()["finish_reason"] == "abort"


def test_sglang_memory_tags_are_strict_and_vllms_sleep_is_not(server):
    release, resume = "/release_memory_occupation", "/resume_memory_occupation"
    assert server.admin.post(release, json={"tags": ["kv_cache"]}).json()["released"] == ["kv_cache"]
    assert "['kv_cache'] are released already" in error_of(server.admin.post(release, json={"tags": ["kv_cache"]}),
                                                             400)["message"]
    assert "['weights'] are not released" in error_of(server.admin.post(resume, json={"tags": ["weights"]}),
                                                       400)["message"]
    assert server.admin.post(resume, json={"tags": ["runtime", "kv_cache"]}).json()["serving"]
    assert "['runtime'] are not released" in error_of(server.admin.post(resume, json={"tags": ["runtime"]}),
                                                       400)["message"]
    assert server.admin.post(resume).status_code == 200  # everything: nothing named, nothing refused
    for _ in range(2):  # vLLM's: a second sleep or wake is a no-op
        assert server.admin.post("/sleep", params={"level": 1}).status_code == 200
    for _ in range(2):
        assert server.admin.post("/wake_up").status_code == 200
    found = metrics(server)
    assert found[("torpor_sleep_level", ())] == -1


def test_sleep_level_gauge_and_mode_keep(server):
    stream = Stream(server).started()
    server.admin.post("/sleep", params={"level": 1, "mode": "keep"}).raise_for_status()
    assert metrics(server)[("torpor_sleep_level", ())] == 1
    assert server.llm.engine.scheduler.waiting and not server.llm.engine.scheduler.running  # kept, its KV gone
    server.admin.post("/wake_up").raise_for_status()
    assert stream.join()["finish_reason"] == "length" and len(stream.tokens()) == LONG
    assert error_of(server.admin.post("/sleep", params={"mode": "later"}), 400)["param"] == "mode"
