"""SGLang's native surface over real HTTP (uvicorn in a thread, the tiny fp32 model on CPU): /generate's
request and answer field by field against SGLang's shapes (io_struct.GenerateReqInput,
tokenizer_manager's meta_info), each answer equal to `LLM.generate` with the mapped `SamplingParams` on
a second engine; the cumulative stream; refusals by name; /health_generate, /get_model_info,
/get_server_info; the API key."""

import itertools
import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_thread import ServerThread, error_of, wait_for

from torpor.engine import LLM, SamplingParams
from torpor.server import ServerConfig, build_app

from .test_server import ENGINE

ADMIN, KEY, MODEL = "admin", "key", "tiny"
PROMPT = "The quick brown fox"
EOS = 1023  # the tiny model's <|im_end|>
HEX_ID = re.compile(r"[0-9a-f]{32}")


@pytest.fixture(scope="module")
def sgl(tiny_model_path):
    served = LLM(tiny_model_path, **ENGINE)
    reference = LLM(tiny_model_path, **ENGINE)  # its own engine: the server's thread alone drives the served one
    app = build_app(served.engine, ServerConfig(MODEL, admin_token=ADMIN, api_key=KEY))
    with ServerThread(app) as url:
        http = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
        admin = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {ADMIN}"})
        yield http, admin, reference, app
        admin.post("/wake_up")


def generate(http, **body) -> dict | list:
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def reference_output(llm, prompt, **params):
    return llm.generate([prompt], SamplingParams(**params))[0]


def stream_chunks(http, **body) -> list[dict]:
    with http.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_generate_text_answer_field_by_field(sgl):
    http, _, llm, _ = sgl
    got = generate(http, text=PROMPT, sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    expected = reference_output(llm, PROMPT, max_tokens=6, temperature=0, ignore_eos=True)
    assert set(got) == {"text", "output_ids", "meta_info"}
    assert got["text"] == expected.outputs[0].text and got["output_ids"] == expected.outputs[0].token_ids
    meta = got["meta_info"]
    assert set(meta) == {"id", "finish_reason", "prompt_tokens", "weight_version", "completion_tokens",
                         "cached_tokens", "e2e_latency", "weight_versions"}
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 6}]
    assert HEX_ID.fullmatch(meta["id"]) and meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(expected.prompt_token_ids) and meta["completion_tokens"] == 6
    assert meta["weight_version"] == "default" and isinstance(meta["cached_tokens"], int)
    assert isinstance(meta["e2e_latency"], float) and meta["e2e_latency"] > 0
    # SGLang's default max_new_tokens is 128: beyond this context of 128 tokens, a 400 (never a silent cut)
    error = error_of(http.post("/generate", json={"text": PROMPT}), 400)
    assert error["param"] == "sampling_params.max_new_tokens" and "128 tokens for the completion" in error["message"]


def test_input_ids_rid_prompt_token_ids_and_cached_tokens(sgl):
    http, _, llm, _ = sgl
    ids = list(range(5, 25))
    first = generate(http, input_ids=ids, rid="my-request", return_prompt_token_ids=True,
                     sampling_params={"max_new_tokens": 3, "temperature": 0})
    expected = reference_output(llm, ids, max_tokens=3, temperature=0)
    assert first["meta_info"]["id"] == "my-request" and first["output_ids"] == expected.outputs[0].token_ids
    assert first["prompt_token_ids"] == ids
    again = generate(http, input_ids=ids, sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert again["meta_info"]["cached_tokens"] >= 16  # whole blocks of the same prompt come from the prefix cache
    assert again["output_ids"] == first["output_ids"]


def test_batches_and_n_samples_are_lists_in_prompt_major_order(sgl):
    http, _, llm, _ = sgl
    params = {"max_new_tokens": 4, "temperature": 0.9, "sampling_seed": 3, "n": 2, "ignore_eos": True}
    got = generate(http, input_ids=[[5, 6, 7], [8, 9]], sampling_params=params)
    assert isinstance(got, list) and len(got) == 4
    for prompt_index, prompt in enumerate([[5, 6, 7], [8, 9]]):
        expected = reference_output(llm, prompt, max_tokens=4, temperature=0.9, seed=3, n=2, ignore_eos=True)
        for sample in range(2):
            entry = got[prompt_index * 2 + sample]
            assert entry["output_ids"] == expected.outputs[sample].token_ids
            assert entry["meta_info"]["prompt_tokens"] == len(prompt) and HEX_ID.fullmatch(entry["meta_info"]["id"])
    assert len({entry["meta_info"]["id"] for entry in got}) == 4  # each sample its own id, as SGLang's
    one = generate(http, text="hi", sampling_params={"max_new_tokens": 2, "n": 2})  # n > 1 makes a batch
    assert isinstance(one, list) and len(one) == 2
    named = generate(http, text=["a", "b"], rid="job", sampling_params={"max_new_tokens": 1})
    assert [entry["meta_info"]["id"] for entry in named] == ["job_0", "job_1"]
    per_prompt = generate(http, text=["a", "b"], sampling_params=[{"max_new_tokens": 1}, {"max_new_tokens": 3}])
    assert [entry["meta_info"]["completion_tokens"] for entry in per_prompt] == [1, 3]


def test_logprobs_as_sglang_returns_them(sgl):
    http, _, llm, _ = sgl
    ids = [5, 6, 7, 8]
    got = generate(http, input_ids=ids, return_logprob=True, logprob_start_len=1, top_logprobs_num=2,
                   return_text_in_logprobs=True, sampling_params={"max_new_tokens": 3, "temperature": 0})
    expected = reference_output(llm, ids, max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=2)
    tokenizer = llm.get_tokenizer()

    def text(token):
        return tokenizer.decode([token], skip_special_tokens=False)

    meta, output = got["meta_info"], expected.outputs[0]
    assert meta["output_token_logprobs"] == [[lp[t].logprob, t, text(t)] for t, lp in zip(
        output.token_ids, output.logprobs, strict=True)]
    assert meta["input_token_logprobs"] == [[expected.prompt_logprobs[i][t].logprob, t, text(t)]
                                            for i, t in enumerate(ids) if i >= 1]
    for top, entries in zip(meta["output_top_logprobs"], output.logprobs, strict=True):
        best = sorted(entries.values(), key=lambda lp: -lp.logprob)[:2]
        assert top == [[lp.logprob, t, text(t)] for t, lp in zip(
            [k for k, _ in sorted(entries.items(), key=lambda kv: -kv[1].logprob)[:2]], best, strict=True)]
    assert len(meta["input_top_logprobs"]) == 3 and all(len(top) == 2 for top in meta["input_top_logprobs"])
    # from the first prompt token: it has no logprob (nothing precedes it), SGLang's null
    whole = generate(http, input_ids=ids, return_logprob=True, logprob_start_len=0, top_logprobs_num=1,
                     sampling_params={"max_new_tokens": 1})["meta_info"]
    assert whole["input_token_logprobs"][0] == [None, 5, None] and whole["input_top_logprobs"][0] is None
    # the default (-1): the output's only; no top lists without top_logprobs_num
    plain = generate(http, input_ids=ids, return_logprob=True, sampling_params={"max_new_tokens": 2})["meta_info"]
    assert plain["input_token_logprobs"] == [] and len(plain["output_token_logprobs"]) == 2
    assert "output_top_logprobs" not in plain and plain["output_token_logprobs"][0][2] is None
    # max_new_tokens 0: the prompt is read, nothing generated
    scored = generate(http, input_ids=ids, return_logprob=True, logprob_start_len=0,
                      sampling_params={"max_new_tokens": 0})
    assert scored["text"] == "" and scored["output_ids"] == [] and scored["meta_info"]["completion_tokens"] == 0
    assert scored["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert [entry[0] for entry in scored["meta_info"]["input_token_logprobs"]] == [None] + [
        expected.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i]
    error = error_of(http.post("/generate", json={"input_ids": ids, "return_logprob": True, "logprob_start_len": 5,
                                                  "sampling_params": {"max_new_tokens": 1}}), 400)
    assert error["param"] == "logprob_start_len" and "higher than the number of input tokens" in error["message"]


def test_stream_is_cumulative_as_sglang_streams(sgl):
    http, _, _, _ = sgl
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
            "return_logprob": True}
    whole = generate(http, **body)
    chunks = stream_chunks(http, **body)
    assert len(chunks) >= 2 and all("index" not in chunk for chunk in chunks)
    for before, after in itertools.pairwise(chunks):
        assert after["text"].startswith(before["text"]) and after["output_ids"][:len(before["output_ids"])] == \
            before["output_ids"]
        assert before["meta_info"]["finish_reason"] is None and "e2e_latency" not in before["meta_info"]
        assert len(before["meta_info"]["output_token_logprobs"]) == before["meta_info"]["completion_tokens"]
    last = chunks[-1]
    assert (last["text"], last["output_ids"]) == (whole["text"], whole["output_ids"])
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 8} and "e2e_latency" in last["meta_info"]
    assert [e[1] for e in last["meta_info"]["output_token_logprobs"]] == whole["output_ids"]
    batch = stream_chunks(http, text=["a", "b"], sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    finals = [c for c in batch if c["meta_info"]["finish_reason"] is not None]
    assert sorted(c["index"] for c in finals) == [0, 1] and all(len(c["output_ids"]) == 3 for c in finals)


def test_sampling_params_mean_what_they_mean_in_sglang(sgl):
    http, _, llm, _ = sgl
    greedy = {"temperature": 0, "ignore_eos": True}
    full = generate(http, text=PROMPT, sampling_params={"max_new_tokens": 12, **greedy})
    stop = full["text"][4:7]
    cut = generate(http, text=PROMPT, sampling_params={"max_new_tokens": 12, "stop": stop, **greedy})
    assert cut["text"] == full["text"][: full["text"].index(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = generate(http, text=PROMPT, sampling_params={"max_new_tokens": 12, "stop": [stop], "no_stop_trim": True,
                                                        **greedy})
    assert kept["text"] == full["text"][: full["text"].index(stop) + len(stop)]
    forced = {"max_new_tokens": 5, "logit_bias": {"77": 100}, "stop_token_ids": [77], "temperature": 0}
    by_token = generate(http, text=PROMPT, sampling_params=forced)
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": 77} and by_token["output_ids"] == [77]
    ignored = generate(http, text=PROMPT, sampling_params={**forced, "ignore_eos": True})  # SGLang: ignores them too
    assert ignored["output_ids"] == [77] * 5 and ignored["meta_info"]["finish_reason"]["type"] == "length"
    eos = generate(http, text=PROMPT, sampling_params={"max_new_tokens": 5, "logit_bias": {str(EOS): 100}})
    assert eos["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS} and eos["text"] == ""
    at_least = generate(http, text=PROMPT, sampling_params={"max_new_tokens": 5, "logit_bias": {str(EOS): 100},
                                                            "min_new_tokens": 3})
    assert at_least["meta_info"]["completion_tokens"] == 4 and at_least["output_ids"][-1] == EOS
    seeded = {"max_new_tokens": 6, "temperature": 1.0, "top_k": 20, "top_p": 0.9, "min_p": 0.05,
              "presence_penalty": 0.5, "frequency_penalty": 0.3}
    one = generate(http, text=PROMPT, sampling_params={**seeded, "sampling_seed": 7})
    assert one["output_ids"] == generate(http, text=PROMPT, sampling_params={**seeded, "seed": 7})["output_ids"]
    assert one["output_ids"] == reference_output(llm, PROMPT, max_tokens=6, temperature=1.0, top_k=20, top_p=0.9,
                                                 min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3,
                                                 seed=7).outputs[0].token_ids
    tiny_temperature = generate(http, text=PROMPT, sampling_params={"max_new_tokens": 6, "temperature": 1e-7})
    assert tiny_temperature["output_ids"] == generate(
        http, text=PROMPT, sampling_params={"max_new_tokens": 6, "temperature": 0})["output_ids"]
    special = generate(http, text=PROMPT, sampling_params={"max_new_tokens": 2, "logit_bias": {str(EOS): 100},
                                                           "min_new_tokens": 2, "ignore_eos": True,
                                                           "skip_special_tokens": False})
    assert special["text"] == "<|im_end|>" * 2
    nulls = {"max_new_tokens": None, "temperature": None, "top_p": None, "ignore_eos": True}  # null: the default
    filled = generate(http, input_ids=list(range(5, 105)), sampling_params=nulls)
    assert filled["meta_info"]["completion_tokens"] == 128 - 100


@pytest.mark.parametrize(("body", "param"), [
    ({"sampling_params": {"repetition_penalty": 1.1}}, "sampling_params.repetition_penalty"),
    ({"sampling_params": {"min_new_tokens": 2, "stop": "x"}}, "sampling_params.min_new_tokens"),
    ({"sampling_params": {"json_schema": "{}"}}, "sampling_params.json_schema"),
    ({"sampling_params": {"spaces_between_special_tokens": False}}, "sampling_params.spaces_between_special_tokens"),
    ({"sampling_params": {"max_tokens": 4}}, "sampling_params.max_tokens"),
    ({"sampling_params": {"max_new_tokens": "4"}}, "sampling_params.max_new_tokens"),
    ({"sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"sampling_params": {"max_new_tokens": 200}}, "sampling_params.max_new_tokens"),
    ({"sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
    ({"sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}}, "sampling_params.min_new_tokens"),
    ({"sampling_params": {"sampling_seed": 2**64}}, "sampling_params.sampling_seed"),
    ({"sampling_params": {"seed": 1, "sampling_seed": 2}}, "sampling_params.seed"),
    ({"sampling_params": {"logit_bias": {"2000": 1}}}, "logit_bias"),
    ({"sampling_params": [{"n": 1}, {"n": 2}], "text": ["a", "b"]}, "sampling_params"),
    ({"sampling_params": [{}, {}, {}], "text": ["a", "b"]}, "sampling_params"),
    ({"token_ids_logprob": [5]}, "token_ids_logprob"),
    ({"image_data": "http://x/y.png"}, "image_data"),
    ({"lora_path": "adapter"}, "lora_path"),
    ({"data_parallel_rank": 1}, "data_parallel_rank"),
    ({"max_tokens": 4}, "max_tokens"),
    ({"top_logprobs_num": 21, "return_logprob": True}, "top_logprobs_num"),
    ({"return_logprob": "yes"}, "return_logprob"),
    ({"rid": ["a", "a"], "text": ["x", "y"]}, "rid"),
    ({"rid": ["a"], "text": ["x", "y"]}, "rid"),
    ({"input_ids": [5, 6]}, "text"),  # both: give one
    ({"text": None, "input_ids": []}, "input_ids"),
    ({"text": None, "input_ids": [True, 5]}, "input_ids.0"),
    ({"text": None, "input_ids": [5, 99999]}, "input_ids"),
    ({"text": ""}, "text"),
    ({"text": "x" * 3000}, "text"),
    ({"text": None, "input_ids": list(range(1, 129))}, "input_ids"),
])
def test_refused_by_name(sgl, body, param):
    http = sgl[0]
    request = {"text": "hi", "sampling_params": {"max_new_tokens": 2}, **body}
    if isinstance(request["sampling_params"], dict):
        request["sampling_params"] = {"max_new_tokens": 2, **request["sampling_params"]}
    if request.get("text") is None:
        request.pop("text")
    error = error_of(http.post("/generate", json=request), 400)
    assert error["param"] == param, error


def test_defaults_of_refused_fields_and_no_effect_fields_are_accepted(sgl):
    http = sgl[0]
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1, "repetition_penalty": 1.0, "json_schema": None,
                                              "spaces_between_special_tokens": True},
            "image_data": None, "lora_path": None, "return_hidden_states": False, "data_parallel_rank": 0,
            "session_id": "s1", "priority": 3, "no_logs": True, "custom_labels": None, "routing_key": "k"}
    assert generate(http, **body)["meta_info"]["completion_tokens"] == 1
    assert http.put("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_a_running_request_id_cannot_be_reused(sgl):
    http = sgl[0]
    body = {"text": "hi", "rid": "busy", "stream": True, "sampling_params": {"max_new_tokens": 120,
                                                                              "ignore_eos": True}}
    with http.stream("POST", "/generate", json=body) as running:
        lines = running.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")  # it runs
        error = error_of(http.post("/generate", json={"text": "hi", "rid": "busy", "sampling_params": {
            "max_new_tokens": 1}}), 400)
        assert error["param"] == "rid" and "busy" in error["message"]
        # a batch with one id in use is refused whole: its other prompt is not queued either
        error = error_of(http.post("/generate", json={"text": ["a", "b"], "rid": ["fresh", "busy"],
                                                      "sampling_params": {"max_new_tokens": 1}}), 400)
        assert error["param"] == "rid" and "busy" in error["message"]
        assert "fresh" not in sgl[3].state.server.engine._engine.request_ids()
    # closing the stream aborted it: the id is free again
    wait_for(lambda: http.post("/generate", json={"text": "hi", "rid": "busy", "sampling_params": {
        "max_new_tokens": 1}}).status_code == 200, what="the aborted request to free its id")


def test_health_generate_and_infos(sgl, tiny_model_path):
    http, admin, _, _ = sgl
    public = httpx.Client(base_url=str(http.base_url), timeout=60)
    assert public.get("/health_generate").status_code == 200  # public, as SGLang's /health*
    admin.post("/sleep", params={"level": 1}).raise_for_status()
    try:
        assert public.get("/health_generate").status_code == 503
    finally:
        admin.post("/wake_up").raise_for_status()
    assert public.get("/health_generate").status_code == 200
    for path in ("/generate", "/get_model_info", "/model_info", "/get_server_info", "/server_info"):
        assert error_of(public.request("POST" if path == "/generate" else "GET", path, json={"text": "hi"}),
                        401)["code"] == "invalid_api_key"
    info = http.get("/get_model_info").json()
    assert info == http.get("/model_info").json()
    assert info == {"model_path": tiny_model_path, "tokenizer_path": tiny_model_path, "is_generation": True,
                    "preferred_sampling_params": None, "weight_version": "default",
                    "has_image_understanding": False, "has_audio_understanding": False, "model_type": "qwen3",
                    "architectures": ["Qwen3ForCausalLM"]}
    answer = admin.post("/update_weight_version", json={"new_version": "step-7"}).json()  # SGLang's and vLLM's
    assert answer == {"success": True, "message": "Weight version updated to step-7", "new_version": "step-7"}
    try:
        assert http.get("/model_info").json()["weight_version"] == "step-7"
        assert admin.get("/weight_info").json() == {"weight_version": "step-7"}
        meta = generate(http, text="hi", sampling_params={"max_new_tokens": 1})["meta_info"]
        assert meta["weight_version"] == "step-7" and meta["weight_versions"][0]["version"] == "step-7"
    finally:
        admin.post("/update_weight_version", json={"new_version": "default"}).raise_for_status()
    server = http.get("/get_server_info").json()
    assert server == http.get("/server_info").json()
    assert server["model_path"] == tiny_model_path and server["served_model_name"] == MODEL
    assert server["context_length"] == 128 and server["max_req_input_len"] == 127 and server["tp_size"] == 1
    assert server["max_running_requests"] == ENGINE["max_num_seqs"] and server["page_size"] == ENGINE["block_size"]
    assert server["max_total_num_tokens"] > 0 and server["weight_version"] == "default"
    assert not {"api_key", "admin_api_key", "admin_token"} & set(server) and KEY not in json.dumps(server)


def test_an_aborted_request_answers_its_partial_output(sgl):
    """A sleep in mode abort (what a trainer's pause does) ends running requests: SGLang's finish reason
    `{"type": "abort", ...}`, the tokens so far kept."""
    http, admin, _, _ = sgl
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 120, "ignore_eos": True}}
    chunks = []
    with ThreadPoolExecutor(1) as pool, http.stream("POST", "/generate", json=body) as response:
        slept = None
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: "):]))
                if slept is None:
                    slept = pool.submit(admin.post, "/sleep", params={"level": 1, "mode": "abort"})
        slept.result(timeout=30).raise_for_status()
    admin.post("/wake_up").raise_for_status()
    last = chunks[-1]["meta_info"]
    assert last["finish_reason"]["type"] == "abort" and "message" in last["finish_reason"]
    assert 1 <= last["completion_tokens"] < 120 and len(chunks[-1]["output_ids"]) == last["completion_tokens"]
