"""vLLM's server surface over real HTTP (tiny fp32 model on CPU): /tokenize and /detokenize, max_model_len
in /v1/models, the checkpoint's generation_config.json defaults for omitted fields, chat-template errors as
400s, /collective_rpc's argument checks (engine/rpc.py); and `torpor serve`'s flags: derived from
EngineConfig's fields, vLLM's spellings, a Hub id served under its name (fake HF cache, offline)."""

import argparse
import dataclasses
import json
import os
import shutil
from types import SimpleNamespace

import httpx
import huggingface_hub.constants
import pytest
from server_thread import ServerThread, error_of

from tests.cpu.test_server_cli import start_server, stop_server
from torpor.cli import serve
from torpor.cli.main import main
from torpor.engine import LLM
from torpor.engine.config import EngineConfig
from torpor.server import ServerConfig, build_app

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8, block_size=4)
ADMIN, MODEL = "admin", "tiny"
# ChatML, refusing a conversation that opens with a tool message (a template that raises on purpose)
TEMPLATE = ("{% if messages[0].role == 'tool' %}{{ raise_exception('no tool turn may open a chat') }}{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{% if tag %}[{{ tag }}]{% endif %}")


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    """A checkpoint whose generation_config.json makes omitted fields greedy, top_k 20, 6 tokens."""
    path = tmp_path_factory.mktemp("gen-config") / "tiny"
    shutil.copytree(tiny_model_path, path)
    config_file = path / "generation_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "temperature": 0.0, "top_k": 20,
                                       "max_new_tokens": 6}))
    llm = LLM(str(path), **ENGINE)
    llm.get_tokenizer().chat_template = TEMPLATE
    with ServerThread(build_app(llm.engine, ServerConfig(MODEL, admin_token=ADMIN))) as url:
        admin = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {ADMIN}"})
        yield SimpleNamespace(llm=llm, tokenizer=llm.get_tokenizer(), http=httpx.Client(base_url=url, timeout=60),
                              admin=admin)


def test_models_list_max_model_len(server):
    assert server.http.get("/v1/models").json()["data"][0]["max_model_len"] == 128


def test_tokenize_prompt_and_messages(server):
    tokenizer = server.tokenizer
    got = server.http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True})
    ids = tokenizer.encode("Hello world")
    assert got.json() == {"count": len(ids), "max_model_len": 128, "tokens": ids,
                          "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    messages = [{"role": "user", "content": "Hi"}]
    chat = server.http.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"tag": "x"}}).json()
    assert chat["tokens"] == tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n[x]",
                                              add_special_tokens=False)
    assert chat["token_strs"] is None
    no_prompt = server.http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    refused = error_of(server.http.post("/tokenize", json={"messages": messages, "chat_template": "{{ 1 }}"}), 400)
    assert refused["param"] == "chat_template"
    assert error_of(server.http.post("/tokenize", json={"model": "gpt-4", "prompt": "a"}), 404)["param"] == "model"


def test_detokenize(server):
    ids = server.tokenizer.encode("Round trip")
    assert server.http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "Round trip"}
    bad = error_of(server.http.post("/detokenize", json={"tokens": [1, 10**9]}), 400)
    assert bad["param"] == "tokens" and "1000000000" in bad["message"]


def test_chat_template_errors_are_400s_naming_them(server):
    messages = [{"role": "tool", "content": "42"}]
    for response in (server.http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}),
                     server.http.post("/tokenize", json={"messages": messages})):
        error = error_of(response, 400)
        assert "no tool turn may open a chat" in error["message"] and error["param"] == "messages"


def test_chat_template_kwargs_reach_the_template(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            "chat_template_kwargs": {"tag": "think-off"}}
    usage = server.http.post("/v1/chat/completions", json=body).json()["usage"]
    expected = server.tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n[think-off]",
                                       add_special_tokens=False)
    assert usage["prompt_tokens"] == len(expected) > len(server.tokenizer.apply_chat_template(
        body["messages"], tokenize=True))
    clash = error_of(server.http.post("/v1/chat/completions", json={
        **body, "chat_template_kwargs": {"add_generation_prompt": False}}), 400)
    assert clash["param"] == "chat_template_kwargs"


def test_chat_template_kwargs_cannot_bring_a_template(server):
    """`chat_template_kwargs: {"chat_template": ...}` ran the client's Jinja (in the event loop: a nested loop
    froze every endpoint, /health included); `tokenize: true` broke /tokenize with a message naming nothing."""
    messages = [{"role": "user", "content": "Hi"}]
    for kwargs in ({"chat_template": "{{ 'injected' }}"}, {"tokenize": True}, {"tag": "x", "messages": []}):
        for path, extra in (("/tokenize", {}), ("/v1/chat/completions", {"max_tokens": 1})):
            error = error_of(server.http.post(path, json={"messages": messages, "chat_template_kwargs": kwargs,
                                                          **extra}), 400)
            assert error["param"] == "chat_template_kwargs" and error["code"] == "unsupported_parameter", error
            assert next(iter(kwargs.keys() - {"tag"})) in error["message"]


def test_generation_config_fills_omitted_fields(server):
    def text(**body):
        answer = server.http.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "ignore_eos": True,
                                                           **body}).json()
        return answer["choices"][0]["text"], answer["usage"]["completion_tokens"]

    defaulted = text()
    assert defaulted[1] == 6  # max_new_tokens, not the OpenAI default of 16
    assert defaulted == text(temperature=0, max_tokens=6)  # greedy: the checkpoint's temperature 0
    assert text(max_tokens=9)[1] == 9  # what a request sets wins
    sampled = {text(temperature=1.0, top_k=-1, seed=s)[0] for s in range(4)}
    assert len(sampled) > 1  # an explicit temperature really samples
    chat = server.http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}).json()
    assert chat["usage"]["completion_tokens"] == 6


def test_collective_rpc_checks_arguments_in_the_engine_table(server):
    def rpc(body):
        return server.admin.post("/collective_rpc", json=body)

    assert rpc({"method": "is_sleeping"}).json() == {"results": [False]}
    assert "level must be int" in error_of(rpc({"method": "sleep", "kwargs": {"level": "1"}}), 400)["message"]
    assert "takes 2 argument(s)" in error_of(rpc({"method": "sleep", "args": [1, "wait", 0]}), 400)["message"]
    assert "not available over HTTP" in error_of(rpc({"method": "update_weights", "args": [[]]}), 400)["message"]
    assert error_of(rpc({"method": "shutdown"}), 400)["param"] == "method"
    assert rpc({"method": "is_sleeping"}).json() == {"results": [False]}


# ---- torpor serve's flags ------------------------------------------------------------------------
def test_every_engine_config_field_is_a_flag_or_internal():
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    assert not (set(serve.ENGINE_FLAGS) & serve.NOT_FLAGS)
    assert set(fields) - serve.NOT_FLAGS <= set(serve.ENGINE_FLAGS), "add a help text to serve.ENGINE_FLAGS"
    for name in set(fields) - serve.NOT_FLAGS:
        assert fields[name].type == "bool" or fields[name].type in serve._FIELD_TYPES, name


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_flags_follow_engine_config_and_vllm_spellings():
    args = parse(["--model", "Org/Name", "--block-size", "8", "--max-num-batched-tokens", "4096", "--dtype", "half",
                  "--no-enforce-eager", "--enable-sleep-mode", "--uvicorn-log-level", "debug", "--tp", "2",
                  "--generation-config", "vllm", "--tokenizer", "Org/Tok", "--seed", "7"])
    assert serve._check_args(args) is None and args.model == "Org/Name" and args.log_level == "debug"
    options = serve.engine_options(args)
    assert options == {**{f: getattr(args, f) for f in serve.ENGINE_FLAGS if hasattr(args, f)},
                       "block_size": 8, "max_num_batched_tokens": 4096, "dtype": "half", "enforce_eager": False,
                       "tensor_parallel_size": 2, "generation_config": "vllm", "tokenizer": "Org/Tok", "seed": 7}
    defaults = serve.engine_options(parse([]))
    assert defaults["block_size"] == EngineConfig.block_size and defaults["max_model_len"] is None
    assert defaults["generation_config"] == "auto" and defaults["enforce_eager"] is False
    if "enable_prefix_caching" in EngineConfig.__dataclass_fields__:  # the generation work's field
        assert parse(["--no-enable-prefix-caching"]).enable_prefix_caching is False


@pytest.mark.parametrize("argv, problem", [
    (["a", "--model", "b"], "two different models"),
    (["--block-size", "12"], "block_size must be a power of two"),
    (["--chat-template", "/no/such/template.jinja"], "neither a file nor Jinja"),
    (["--chat-template", "{% for %}"], "does not compile"),
])
def test_bad_options_exit_2_before_loading(argv, problem, capsys):
    assert main(["serve", *argv, "--device", "cpu", "--port", "0"]) == 2
    assert problem in capsys.readouterr().err


def test_missing_hub_model_says_where_it_looked(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert main(["serve", "Org/Absent", "--device", "cpu", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "the engine could not start" in err and f"no cached snapshot of the Hugging Face Hub repository in " \
        f"{tmp_path} (HF_HUB_OFFLINE is set)" in err


@pytest.mark.slow
def test_serve_a_hub_id_offline_with_a_chat_template_file(tiny_model_path, tmp_path):
    repo = tmp_path / "hub" / "models--Org--Tiny"
    shutil.copytree(tiny_model_path, repo / "snapshots" / "rev1")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("rev1")
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HF_")}, "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_HUB_OFFLINE": "1", "TORPOR_API_KEY": ""}
    argv = ["--model", "Org/Tiny", "--device", "cpu", "--port", "0", "--max-model-len", "64", "--max-num-seqs", "2",
            "--block-size", "8", "--chat-template", str(template), "--enable-sleep-mode", "--uvicorn-log-level",
            "warning"]
    process, url, lines = start_server(argv, env)
    try:
        assert "serving 'Org/Tiny'" in lines[-1]
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.get("/v1/models").json()["data"][0]["id"] == "Org/Tiny"
            tokens = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
            assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == "[user] hi\n"
    finally:
        if process.poll() is None:
            assert "stopped" in stop_server(process)
