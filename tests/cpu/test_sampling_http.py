"""The sampling options over real HTTP (uvicorn in a thread, the tiny fp32 model on CPU, the official
`openai` client): every option reaches the engine (the answer equals `LLM.generate` with the same
`SamplingParams`), bad values and unbuilt features are a 400 naming the field."""

import json

import httpx
import openai
import pytest
from server_thread import ServerThread

from torpor.engine import LLM, SamplingParams
from torpor.server import ServerConfig, build_app

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8, block_size=4)
PROMPT = "The quick brown fox"
EOS = 1023  # the tiny model's <|im_end|>


@pytest.fixture(scope="module")
def server(tiny_model_path):
    served = LLM(tiny_model_path, **ENGINE)
    reference = LLM(tiny_model_path, **ENGINE)  # its own engine: the server's thread alone drives the served one
    with ServerThread(build_app(served.engine, ServerConfig("tiny"))) as url:
        yield reference, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60), \
            httpx.Client(base_url=url, timeout=60)


def engine_text(llm: LLM, prompt, **params) -> str:
    return llm.generate([prompt], SamplingParams(**params))[0].outputs[0].text


# Request fields (OpenAI's, then vLLM's extras) and the SamplingParams they must become.
CASES = {
    "penalties": ({"presence_penalty": 1.5, "frequency_penalty": 0.7}, {"repetition_penalty": 1.4},
                  dict(presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.4)),
    "logit_bias": ({"logit_bias": {"321": 100, "5": -3}}, {}, dict(logit_bias={321: 100, 5: -3})),
    "min_tokens": ({"logit_bias": {str(EOS): 100}}, {"min_tokens": 4, "ignore_eos": False},
                   dict(logit_bias={EOS: 100}, min_tokens=4, ignore_eos=False)),
    "special tokens": ({"logit_bias": {str(EOS): 100}}, {"skip_special_tokens": False},
                       dict(logit_bias={EOS: 100}, skip_special_tokens=False, ignore_eos=True)),
    "seeded min_p": ({"temperature": 1.0, "seed": 9}, {"min_p": 0.2},
                     dict(temperature=1.0, seed=9, min_p=0.2, ignore_eos=True)),
}


@pytest.mark.parametrize("name", CASES)
def test_completions_pass_every_option(server, name):
    llm, client, _ = server
    openai_fields, extras, params = CASES[name]
    body = {"temperature": 0, "max_tokens": 8, **openai_fields}
    completion = client.completions.create(model="tiny", prompt=PROMPT, **body,
                                           extra_body={"ignore_eos": True, **extras})
    expected = engine_text(llm, PROMPT, **{"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, **params})
    assert completion.choices[0].text == expected
    if name == "special tokens":
        assert expected == "<|im_end|>" * 8
    if name == "min_tokens":
        assert completion.usage.completion_tokens == 5 and completion.choices[0].finish_reason == "stop"


def test_include_stop_str_in_output(server):
    llm, client, _ = server
    full = engine_text(llm, PROMPT, temperature=0.0, max_tokens=16, ignore_eos=True)
    start = next(i for i in range(2, len(full) - 2) if full.index(full[i:i + 2]) == i)
    stop = full[start:start + 2]
    body = dict(model="tiny", prompt=PROMPT, temperature=0, max_tokens=16, stop=[stop])
    cut = client.completions.create(**body, extra_body={"ignore_eos": True})
    kept = client.completions.create(**body, extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert cut.choices[0].text == full[:start] and kept.choices[0].text == full[:start + 2]


def test_streamed_text_equals_the_whole_text(server):
    llm, client, _ = server
    # <|im_end|> first (biased), then ordinary text (the repetition penalty divides its biased logit).
    special_first = {"logit_bias": {str(EOS): 50}, "extra_body": {"ignore_eos": True, "repetition_penalty": 50,
                                                                  "skip_special_tokens": False}}
    full = engine_text(llm, PROMPT, temperature=0.0, max_tokens=12, ignore_eos=True)
    start = next(i for i in range(2, len(full) - 2) if full.index(full[i:i + 2]) == i)
    keep_stop = {"stop": [full[start:start + 2]],
                 "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}}
    for extra in (special_first, keep_stop):
        body = dict(model="tiny", prompt=PROMPT, temperature=0, max_tokens=12, **extra)
        whole = client.completions.create(**body).choices[0].text
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(**body, stream=True)
                           if chunk.choices)
        assert streamed == whole
        assert whole.startswith("<|im_end|>") and len(whole) > 12 if extra is special_first else \
            whole == full[:start + 2]


def test_chat_passes_the_options(server):
    llm, client, _ = server
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=3,
        logit_bias={"321": 100}, logprobs=True, top_logprobs=20, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == llm.tokenizer.decode([321] * 3)  # the forced token
    assert [len(t.top_logprobs) for t in chat.choices[0].logprobs.content] == [20] * 3


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"suffix": "done"}, "suffix"),
    ("/v1/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # auto
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": []}, "tools"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"1024": 1}}, "logit_bias"),
    ("/v1/completions", {"stop_token_ids": [1024], "min_tokens": 1}, "stop_token_ids"),
    ("/v1/chat/completions", {"stop_token_ids": [7, 99999]}, "stop_token_ids"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_refused_with_the_field_named(server, path, extra, param):
    _, _, http = server
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    response = http.post(path, json={**body, "max_tokens": 4, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_out_of_vocab_logit_bias_is_a_400_naming_it(server):
    _, _, http = server
    response = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "logit_bias": {"1024": 1}})
    assert response.status_code == 400 and "logit_bias" in response.json()["error"]["message"]


@pytest.mark.parametrize(("path", "extra"), [
    ("/v1/completions", {"best_of": 1, "echo": False, "suffix": None, "response_format": {"type": "text"}}),
    ("/v1/chat/completions", {"tools": None, "tool_choice": "none", "response_format": {"type": "text"}}),
])
def test_defaults_of_refused_fields_are_accepted(server, path, extra):
    _, _, http = server
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    assert http.post(path, json={**body, "max_tokens": 2, **extra}).status_code == 200


def test_stop_reason_names_what_ended_each_choice(server):
    """vLLM's `stop_reason` on every choice, whole and streamed: the stop string or stop token id that
    ended it, null for eos and length."""
    _, _, http = server
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions",
                                                                   {"messages": [{"role": "user", "content": "hi"}]})):
        body = {**body, "temperature": 0, "max_tokens": 16, "ignore_eos": True}
        choice = http.post(path, json=body).json()["choices"][0]
        full = choice["text"] if "text" in choice else choice["message"]["content"]
        start = next(i for i in range(2, len(full) - 2) if full.index(full[i:i + 2]) == i)
        cases = [({"stop": [full[start:start + 2]]}, "stop", full[start:start + 2]),
                 ({"logit_bias": {"77": 100}, "stop_token_ids": [77]}, "stop", 77),
                 ({"logit_bias": {str(EOS): 100}, "ignore_eos": False}, "stop", None),
                 ({}, "length", None)]
        for extra, finish_reason, stop_reason in cases:
            request = {**body, **extra}
            choice = http.post(path, json=request).json()["choices"][0]
            assert (choice["finish_reason"], choice["stop_reason"]) == (finish_reason, stop_reason), (path, extra)
            with http.stream("POST", path, json={**request, "stream": True}) as response:
                chunks = [json.loads(line[6:]) for line in response.iter_lines()
                          if line.startswith("data: {") and '"choices":[{' in line.replace(" ", "")]
            reasons = [(c["choices"][0].get("finish_reason"), c["choices"][0].get("stop_reason")) for c in chunks]
            assert reasons[-1] == (finish_reason, stop_reason) and set(reasons[:-1]) <= {(None, None)}, (path, extra)
