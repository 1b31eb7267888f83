"""Tool calls for multi-turn agentic rollouts. The Hermes parser on its own (whole outputs, and streamed in
every chunking), then the server path over real HTTP: the tiny model's tokenizer is given tokens that spell
whole tool calls (a real checkpoint variation: the synthetic weights will not write one by themselves),
which `logit_bias` makes the model emit; the chat template renders the tools and the multi-turn messages
(assistant tool_calls, tool results) the way vLLM hands them to it; tool_choice and message validation."""

import json
import random
import shutil

import httpx
import pytest
from server_thread import ServerThread, error_of

from torpor.cli.main import main
from torpor.engine import LLM
from torpor.server import ServerConfig, build_app
from torpor.server.tool_calls import HermesToolParser, partial_overlap

from .test_server import ENGINE

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SAID_AND_CALLED = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nice"}}\n</tool_call>'
TWO_CALLS = ('<tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": "}"}]}}\n</tool_call>\n'
             '<tool_call>\n{"name": "b", "arguments": {"s": "say \\"hi\\""}}\n</tool_call>')
CRAFTED = {1020: ("othing", ["ot", "hing"], CALL), 1019: ("oth", ["ot", "h"], SAID_AND_CALLED),
           1018: ("def", ["de", "f"], TWO_CALLS)}  # id: (the token it replaces, the merge made it, the new text)
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": CITY}}]
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}{% if m.name %}({{ m.name }}){% endif %}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{%- endfor %}"
    "{%- if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ---- the parser ---------------------------------------------------------------------------------
def test_hermes_extract():
    parser = HermesToolParser()
    assert parser.extract("no call here") == ("no call here", [])
    content, calls = parser.extract(SAID_AND_CALLED)
    assert content == "Let me check.\n" and len(calls) == 1
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Nice"}'}
    content, calls = parser.extract(TWO_CALLS)
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"x": [1, {"y": "}"}]}, {"s": 'say "hi"'}]
    assert parser.extract('<tool_call>{"name": "f", "arguments": {}}')[1][0]["function"]["name"] == "f"  # unclosed
    for broken in ('<tool_call>{"name": "f", "arguments": {</tool_call>', '<tool_call>{"name": "f"}</tool_call>',
                   "<tool_call>[1]</tool_call>"):
        assert parser.extract(broken) == (broken, [])  # not a call: plain text (vLLM's behaviour)


@pytest.mark.parametrize("text", [CALL, SAID_AND_CALLED, TWO_CALLS, "plain text ending in <tool", "a < b <tool_c"])
def test_hermes_stream_in_any_chunking(text):
    """The deltas of any chunking add up to what `extract` finds: the content, each call's name once (with
    its id), its arguments exactly as the model wrote them."""
    expected_content, expected_calls = HermesToolParser().extract(text)
    rng = random.Random(len(text))
    for _ in range(20):
        stream, so_far, content, calls = HermesToolParser().stream(), "", "", {}
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        for piece in (text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)):
            so_far += piece
            delta, deltas = stream.feed(so_far, final=len(so_far) == len(text))
            content += delta
            for d in deltas:
                call = calls.setdefault(d["index"], {"arguments": ""})
                if "id" in d:
                    assert "name" not in call and d["type"] == "function"
                    call.update(id=d["id"], name=d["function"]["name"])
                call["arguments"] += d["function"].get("arguments", "")
        if expected_calls:
            assert content == (expected_content or "") and stream.called
            assert [calls[i]["name"] for i in sorted(calls)] == [c["function"]["name"] for c in expected_calls]
            assert [json.loads(calls[i]["arguments"]) for i in sorted(calls)] == [
                json.loads(c["function"]["arguments"]) for c in expected_calls]
        else:
            assert content == text and not calls and not stream.called


def test_partial_overlap():
    assert partial_overlap("abc <tool", "<tool_call>") == 5
    assert partial_overlap("abc", "<tool_call>") == 0 and partial_overlap("<", "<tool_call>") == 1


# ---- the server path ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def agent(tiny_model_path, tmp_path_factory):
    """The tiny checkpoint with tokens that spell tool calls, a tool-use chat template, `--tool-call-parser
    hermes --enable-auto-tool-choice`."""
    path = tmp_path_factory.mktemp("tool-calls") / "tiny"
    shutil.copytree(tiny_model_path, path)
    spec = json.loads((path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    for token_id, (old, merge, text) in CRAFTED.items():
        assert vocab.pop(old) == token_id
        vocab[text] = token_id
        spec["model"]["merges"].remove(merge)
        spec["added_tokens"].append({"id": token_id, "content": text, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": False})
    (path / "tokenizer.json").write_text(json.dumps(spec))
    llm = LLM(str(path), **{**ENGINE, "max_model_len": 1024})  # rendered tools take a few hundred tokens
    llm.get_tokenizer().chat_template = TEMPLATE
    config = ServerConfig("tiny", tool_call_parser="hermes", enable_auto_tool_choice=True)
    with ServerThread(build_app(llm.engine, config)) as url:
        yield httpx.Client(base_url=url, timeout=60), llm.get_tokenizer()


def ask(http, token_id: int | None = None, **body) -> httpx.Response:
    forced = {"logit_bias": {str(token_id): 100}, "max_tokens": 1} if token_id is not None else {"max_tokens": 2}
    return http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "weather?"}],
                                                   "tools": TOOLS, **forced, **body})


def test_the_output_is_read_for_tool_calls(agent):
    http, _ = agent
    choice = ask(http, 1020).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    said = ask(http, 1019, tool_choice="auto").json()["choices"][0]
    assert said["message"]["content"] == "Let me check.\n" and said["finish_reason"] == "tool_calls"
    assert json.loads(said["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Nice"}
    both = ask(http, 1018).json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in both] == ["a", "b"] and len({c["id"] for c in both}) == 2
    plain = ask(http).json()["choices"][0]  # no call in the output: plain content, the engine's finish reason
    assert "tool_calls" not in plain["message"] and plain["finish_reason"] == "length"
    # tool_choice "none": the tools are rendered, the output is not read
    untouched = ask(http, 1020, tool_choice="none").json()["choices"][0]
    assert untouched["message"]["content"] == CALL and "tool_calls" not in untouched["message"]


def test_tool_calls_stream_as_vllm_streams_them(agent):
    http, _ = agent
    with http.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, "stream": True,
            "logit_bias": {"1019": 100}, "max_tokens": 1}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check.\n"
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert calls[0]["index"] == 0 and calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "get_weather"}
    assert "".join(c["function"].get("arguments", "") for c in calls) == '{"city": "Nice"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_template_renders_tools_and_multi_turn_tool_messages(agent):
    http, tokenizer = agent
    messages = [
        {"role": "user", "content": "weather in Paris?", "name": "ada", "cache_control": {"type": "ephemeral"}},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    answer = http.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "max_tokens": 1,
                                                     "return_token_ids": True})
    assert answer.status_code == 200, answer.text
    rendered = tokenizer.decode(answer.json()["prompt_token_ids"], skip_special_tokens=False)
    assert json.dumps(TOOLS[0]) in rendered  # vLLM's tool dict (description, parameters) reaches the template
    assert "<|im_start|>user(ada)weather in Paris?" in rendered  # name reaches it; cache_control is ignored
    # the arguments reach the template as an object (vLLM parses the JSON text), not as a string
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in rendered
    assert "<|im_start|>toolsunny[call_1]<|im_end|>" in rendered
    assert answer.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(rendered, add_special_tokens=False))
    # /tokenize renders a conversation as chat completions does (a trainer rebuilds the rollout's prompt)
    tokenized = http.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
    assert tokenized == answer.json()["prompt_token_ids"]


@pytest.mark.parametrize(("body", "param", "text"), [
    ({"messages": [{"role": "user"}]}, "messages.0.content", "needs 'content'"),
    ({"messages": [{"role": "system", "content": None}, {"role": "user", "content": "x"}]}, "messages.0.content",
     "needs 'content'"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]}, "messages.1.content", "tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages.0.tool_calls.0.function.arguments", "JSON"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f",
                                                                                   "arguments": {"a": 1}}}]}]},
     "messages.0.tool_calls.0.function.arguments", "string"),
    ({"tools": []}, "tools", "must not be an empty array"),
    ({"tool_choice": "required"}, "tool_choice", "guided decoding"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice", "guided decoding"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "does not match"),
    ({"tool_choice": "sometimes"}, "tool_choice", "Input should be"),
    ({"tools": None, "tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name", "at least 1"),
])
def test_messages_and_tools_are_validated(agent, body, param, text):
    http, _ = agent
    request = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 1, **body}
    error = error_of(http.post("/v1/chat/completions", json=request), 400)
    assert error["param"] == param and text in error["message"], error


def test_an_assistant_message_with_tool_calls_needs_no_content(agent):
    http, _ = agent
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}]
    assert http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).status_code == 200


def test_tool_parsing_reads_special_tokens(agent):
    """vLLM's Hermes parser turns skip_special_tokens off (a model's <tool_call> may be a special token)."""
    http, _ = agent
    body = {"logit_bias": {"1023": 100}, "min_tokens": 2, "max_tokens": 2, "ignore_eos": True}
    assert ask(http, **body, tool_choice="auto").json()["choices"][0]["message"]["content"] == "<|im_end|>" * 2
    assert ask(http, **body, tool_choice="none").json()["choices"][0]["message"]["content"] == ""


def test_auto_needs_the_flags(tiny_model_path):
    with pytest.raises(ValueError, match="requires tool_call_parser"):
        ServerConfig("tiny", enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ServerConfig("tiny", tool_call_parser="mistral")
    assert main(["serve", tiny_model_path, "--enable-auto-tool-choice"]) == 2
    assert main(["serve", tiny_model_path, "--tool-call-parser", "mistral"]) == 2
