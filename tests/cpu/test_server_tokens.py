"""vLLM's token-level fields that RL and agent loops read, over real HTTP (the tiny fp32 model on CPU),
each checked against `LLM.generate` on a second engine: `return_token_ids` (completions and chat, whole
and streamed), `return_tokens_as_token_ids`, `prompt_logprobs` (null when not asked), `echo`,
`usage.prompt_tokens_details.cached_tokens`, `stream_options.continuous_usage_stats`, and the 400s of
a max_tokens beyond the context."""

import json

import httpx
import pytest
from server_thread import ServerThread, error_of

from torpor.engine import LLM, SamplingParams
from torpor.server import ServerConfig, build_app

from .test_server import ENGINE

MODEL = "tiny"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def env(tiny_model_path):
    served = LLM(tiny_model_path, **ENGINE)
    reference = LLM(tiny_model_path, **ENGINE)
    with ServerThread(build_app(served.engine, ServerConfig(MODEL))) as url:
        yield httpx.Client(base_url=url, timeout=60), reference


def post(http, path: str, **body) -> dict:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def events(http, path: str, **body) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_completions_return_token_ids(env):
    http, llm = env
    prompts = ["Token ids, please", "And for this one"]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 5, "n": 2, "return_token_ids": True, **GREEDY}
    whole = post(http, "/v1/completions", **body)
    for choice in whole["choices"]:
        prompt = prompts[choice["index"] // 2]
        expected = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
        assert choice["prompt_token_ids"] == expected.prompt_token_ids
        assert choice["token_ids"] == expected.outputs[0].token_ids and choice["text"] == expected.outputs[0].text
    streamed: dict[int, list] = {}
    for chunk in events(http, "/v1/completions", **body):
        for choice in chunk["choices"]:
            first = choice["index"] not in streamed
            assert (choice["prompt_token_ids"] is not None) == first  # vLLM: only in each choice's first chunk
            streamed.setdefault(choice["index"], []).extend(choice["token_ids"])
    assert streamed == {c["index"]: c["token_ids"] for c in whole["choices"]}
    plain = post(http, "/v1/completions", prompt="hi", max_tokens=2)["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None and plain["prompt_logprobs"] is None


def test_chat_return_token_ids(env):
    http, llm = env
    messages = [{"role": "user", "content": "ids of a chat"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "return_token_ids": True, **GREEDY}
    whole = post(http, "/v1/chat/completions", **body)
    prompt_ids = llm.get_tokenizer().apply_chat_template(messages, tokenize=True)
    expected = llm.generate([prompt_ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert whole["prompt_token_ids"] == prompt_ids and whole["prompt_logprobs"] is None
    assert whole["choices"][0]["token_ids"] == expected.outputs[0].token_ids
    chunks = events(http, "/v1/chat/completions", **body)
    assert chunks[0]["prompt_token_ids"] == prompt_ids and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == expected.outputs[0].token_ids
    plain = post(http, "/v1/chat/completions", messages=messages, max_tokens=1)
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None  # vLLM's nulls


def test_return_tokens_as_token_ids(env):
    http, _ = env
    completion = post(http, "/v1/completions", prompt="as ids", max_tokens=3, logprobs=2, return_token_ids=True,
                      return_tokens_as_token_ids=True, **GREEDY)["choices"][0]
    assert completion["logprobs"]["tokens"] == [f"token_id:{t}" for t in completion["token_ids"]]
    assert all(key.startswith("token_id:") for top in completion["logprobs"]["top_logprobs"] for key in top)
    offsets = completion["logprobs"]["text_offset"]
    assert offsets == [sum(len(t) for t in completion["logprobs"]["tokens"][:i]) for i in range(3)]
    chat = post(http, "/v1/chat/completions", messages=[{"role": "user", "content": "as ids"}], max_tokens=3,
                logprobs=True, top_logprobs=2, return_token_ids=True, return_tokens_as_token_ids=True, **GREEDY)
    content = chat["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [f"token_id:{t}" for t in chat["choices"][0]["token_ids"]]
    assert all(top["token"].startswith("token_id:") for entry in content for top in entry["top_logprobs"])


def test_prompt_logprobs_as_vllm_returns_them(env):
    http, llm = env
    prompt = "Score this prompt"
    expected = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    vllm_shape = [None if position is None else {str(token): {"logprob": lp.logprob, "rank": lp.rank,
                                                               "decoded_token": lp.decoded_token}
                                                  for token, lp in position.items()}
                  for position in expected.prompt_logprobs]
    choice = post(http, "/v1/completions", prompt=prompt, max_tokens=1, temperature=0, prompt_logprobs=2)["choices"][0]
    assert choice["prompt_logprobs"] == vllm_shape and vllm_shape[0] is None and len(vllm_shape[1]) in (2, 3)
    messages = [{"role": "user", "content": "score the chat"}]
    prompt_ids = llm.get_tokenizer().apply_chat_template(messages, tokenize=True)
    chat_expected = llm.generate([prompt_ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    chat = post(http, "/v1/chat/completions", messages=messages, max_tokens=1, temperature=0, prompt_logprobs=1)
    assert [None if p is None else sorted(p) for p in chat["prompt_logprobs"]] == [
        None if p is None else sorted(map(str, p)) for p in chat_expected.prompt_logprobs]
    assert error_of(http.post("/v1/completions", json={"prompt": "x", "prompt_logprobs": 1, "stream": True}),
                    400)["message"] == "`prompt_logprobs` are not available when `stream=True`."
    assert http.post("/v1/completions", json={"prompt": "x", "prompt_logprobs": 0, "stream": True,
                                              "max_tokens": 1}).status_code == 200
    assert error_of(http.post("/v1/completions", json={"prompt": "x", "prompt_logprobs": 21}), 400)["param"] == \
        "prompt_logprobs"


def test_echo(env):
    http, llm = env
    prompt = "Echo me"
    expected = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=1,
                                                     prompt_logprobs=1))[0]
    choice = post(http, "/v1/completions", prompt=prompt, max_tokens=3, logprobs=1, echo=True, **GREEDY)["choices"][0]
    assert choice["text"] == prompt + expected.outputs[0].text
    logprobs = choice["logprobs"]
    num_prompt = len(expected.prompt_token_ids)
    assert len(logprobs["tokens"]) == num_prompt + 3 and logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:num_prompt] == [
        expected.prompt_logprobs[i][t].logprob for i, t in enumerate(expected.prompt_token_ids) if i]
    assert logprobs["token_logprobs"][num_prompt:] == [lp[t].logprob for t, lp in zip(
        expected.outputs[0].token_ids, expected.outputs[0].logprobs, strict=True)]
    assert choice["prompt_logprobs"] is not None  # echo with logprobs computes them (vLLM)
    only = post(http, "/v1/completions", prompt=[5, 6, 7], max_tokens=0, echo=True)["choices"][0]
    assert only["text"] == llm.get_tokenizer().decode([5, 6, 7], skip_special_tokens=False)
    assert error_of(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}), 400)["param"] == "max_tokens"
    first = next(c for c in events(http, "/v1/completions", prompt=prompt, max_tokens=2, echo=True) if c["choices"])
    assert first["choices"][0]["text"].startswith(prompt)
    ids_only = post(http, "/v1/completions", prompt=prompt, max_tokens=2, echo=True, return_token_ids=True, **GREEDY)
    assert ids_only["choices"][0]["text"] == expected.outputs[0].text[:len(ids_only["choices"][0]["text"])]
    # chat: the reply starts with the assistant's last message (continue_final_message)
    messages = [{"role": "user", "content": "go on"}, {"role": "assistant", "content": "Once upon"}]
    chat = post(http, "/v1/chat/completions", messages=messages, max_tokens=2, echo=True, add_generation_prompt=False,
                continue_final_message=True, **GREEDY)
    assert chat["choices"][0]["message"]["content"].startswith("Once upon")


def test_cached_tokens_in_usage(env):
    http, llm = env
    prompt = list(range(40, 70))  # 30 tokens: 7 whole blocks of 4
    counts = [post(http, "/v1/completions", prompt=prompt, max_tokens=1)["usage"]["prompt_tokens_details"]
              ["cached_tokens"] for _ in range(2)]
    expected = [llm.generate([prompt], SamplingParams(max_tokens=1))[0].num_cached_tokens for _ in range(2)]
    assert counts == expected and counts[0] == 0 and counts[1] >= 28
    chunks = events(http, "/v1/chat/completions", messages=[{"role": "user", "content": "cached?"}], max_tokens=1,
                    stream_options={"include_usage": True})
    assert "cached_tokens" in chunks[-1]["usage"]["prompt_tokens_details"]


def test_continuous_usage_stats(env):
    http, _ = env
    for path, body in (("/v1/completions", {"prompt": [5, 6, 7]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "count"}]})):
        chunks = events(http, path, **body, max_tokens=4, stream_options={"include_usage": True,
                                                                           "continuous_usage_stats": True}, **GREEDY)
        steps = [c for c in chunks if c["choices"] and (c["choices"][0].get("text") or
                                                         c["choices"][0].get("delta", {}).get("content") is not None)]
        usages = [c["usage"] for c in chunks if c["choices"]]
        assert len({u["prompt_tokens"] for u in usages}) == 1 and steps
        assert [u["completion_tokens"] for u in usages][-4:] == [1, 2, 3, 4]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_max_tokens_beyond_the_context_is_a_400(env):
    http, _ = env
    error = error_of(http.post("/v1/completions", json={"prompt": list(range(1, 101)), "max_tokens": 40}), 400)
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    assert "You passed 100 input tokens and requested 40 output tokens" in error["message"]
    assert "context length is only 128 tokens" in error["message"]
    error = error_of(http.post("/v1/completions", json={"prompt": list(range(1, 129))}), 400)
    assert error["param"] == "prompt" and "maximum context length is 128 tokens" in error["message"]
    error = error_of(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "max_completion_tokens": 500}), 400)
    assert error["param"] == "max_completion_tokens" and "cannot be greater than max_model_len=128" in error["message"]
    # omitted: what the context leaves (vLLM's default for chat)
    usage = post(http, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], **GREEDY)["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 128
    assert post(http, "/v1/completions", prompt="hi", seed=2**63 - 1, max_tokens=1)["usage"]["completion_tokens"] == 1
