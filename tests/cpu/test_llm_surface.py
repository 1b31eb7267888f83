"""vLLM's Python surface on CPU (tiny fp32 model): `from torpor import LLM`, `LLM.chat`, `get_tokenizer`,
`collective_rpc`, dict prompts, `Logprob` entries, generation-config defaults, and models named by their
Hugging Face Hub id, resolved through a real huggingface_hub over a fake local cache (no network)."""

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest

from torpor import LLM, Logprob, SamplingParams
from torpor.engine.chat_template import ChatTemplateError
from torpor.engine.generation_config import generation_defaults
from torpor.engine.model_path import resolve_model

ENGINE = dict(device="cpu", dtype="float32", max_model_len=96, max_num_seqs=8, block_size=4)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


def greedy(max_tokens=8, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(tiny_model_path, **ENGINE)


def fake_hub_cache(root: Path, checkpoint: str, repo_id: str = "Org/Tiny", revision: str = "0123abcd") -> Path:
    """The Hugging Face cache layout: models--Org--Name/{refs/main, snapshots/REV/<files>}."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(checkpoint, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return repo / "snapshots" / revision


def test_import_torpor_is_light_and_exports_vllm_names():
    code = ("import sys, torpor; assert 'torch' not in sys.modules, 'import torpor pulled in torch'; "
            "from torpor import LLM, SamplingParams, Logprob; print(LLM.__module__, SamplingParams.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["torpor.engine.llm", "torpor.engine.sampling_params"]
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        import torpor

        torpor.Nope  # noqa: B018


def test_chat_renders_the_template_and_generates(llm):
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.engine.tokenizer
    text = tokenizer.apply_chat_template(CONVERSATION)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n"
                    "<|im_start|>assistant\n")
    [chat] = llm.chat(CONVERSATION, greedy())
    [plain] = llm.generate([tokenizer.encode(text, add_special_tokens=False)], greedy())
    assert chat.prompt == text and chat.prompt_token_ids == plain.prompt_token_ids
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    two = llm.chat([CONVERSATION, CONVERSATION[1:]], greedy())  # a list of conversations
    assert [o.outputs[0].token_ids for o in two[:1]] == [chat.outputs[0].token_ids] and len(two) == 2
    assert two[1].prompt == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_override_kwargs_and_errors(llm):
    template = "{{ greeting }} {% for m in messages %}{{ m.content }}{% endfor %}"
    [out] = llm.chat(CONVERSATION, greedy(2), chat_template=template, chat_template_kwargs={"greeting": "Yo"})
    assert out.prompt == "Yo Be brief.Hello there"
    [cont] = llm.chat([*CONVERSATION, {"role": "assistant", "content": "Sure, "}], greedy(2),
                      add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt.endswith("<|im_start|>assistant\nSure, ")
    with pytest.raises(ChatTemplateError, match="no thanks"):  # raise_exception inside the template
        llm.chat(CONVERSATION, greedy(), chat_template="{{ raise_exception('no thanks') }}")
    with pytest.raises(ValueError, match="messages\\[1\\] must be a dict"):
        llm.chat([CONVERSATION[0], "hi"], greedy())
    assert llm.engine.is_finished()  # nothing was queued by the failed calls


def test_dict_prompts_match_plain_prompts(llm):
    ids = llm.get_tokenizer().encode("Once upon")
    plain = llm.generate(["Hello", ids], greedy())
    as_dicts = llm.generate([{"prompt": "Hello"}, {"prompt_token_ids": ids}], greedy())
    assert [o.outputs[0].token_ids for o in as_dicts] == [o.outputs[0].token_ids for o in plain]
    assert as_dicts[0].prompt == "Hello" and as_dicts[1].prompt_token_ids == ids
    assert llm.generate({"prompt": "Hello"}, greedy())[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    for bad, error in [({"prompt": "a", "prompt_token_ids": [1]}, "exactly one"),
                       ({"text": "a"}, "not supported: \\['text'\\]"),
                       ({"prompt": 5}, "must be a string"),
                       ({"prompt_token_ids": "12"}, "list of token ids")]:
        with pytest.raises(ValueError, match=error):
            llm.generate([bad], greedy())


def test_logprob_entries_rank_and_text(llm):
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    [out] = llm.generate(["Tell me a story"], params)
    completion, tokenizer = out.outputs[0], llm.get_tokenizer()
    outside = 0
    for token, entries in zip(completion.token_ids, completion.logprobs, strict=True):
        assert all(isinstance(e, Logprob) for e in entries.values()) and token in entries
        top = sorted((t for t in entries if entries[t].rank is not None), key=lambda t: entries[t].rank)
        assert [entries[t].rank for t in top] == [1, 2]
        assert entries[top[0]].logprob >= entries[top[1]].logprob
        if len(entries) == 3:  # the sampled token is outside the top 2: not ranked
            outside += 1
            assert entries[token].rank is None and entries[token].logprob <= entries[top[1]].logprob
        for t, e in entries.items():
            assert e.decoded_token == tokenizer.decode([t], skip_special_tokens=False)
    assert outside > 0  # at temperature 1.5 some sampled tokens are not among the top 2
    assert out.prompt_logprobs[0] is None
    for token, entries in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
        assert token in entries and sorted(e.rank for e in entries.values() if e.rank) == [1]


def test_cumulative_logprob_sums_the_sampled_tokens_logprobs(llm):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True, n=2, logprobs=0)
    [out] = llm.generate(["Count the stars"], params)
    for completion in out.outputs:
        sampled = [entries[t].logprob for t, entries in zip(completion.token_ids, completion.logprobs, strict=True)]
        assert completion.cumulative_logprob == pytest.approx(sum(sampled), abs=1e-9) and sum(sampled) < 0
    [plain] = llm.generate(["Count the stars"], greedy())
    assert plain.outputs[0].cumulative_logprob is None  # no logprobs asked for: None, as vLLM


@pytest.mark.slow  # a subprocess on a terminal
@pytest.mark.parametrize("use_tqdm", [None, False])
def test_generate_shows_vllms_progress_bar_on_a_terminal_unless_turned_off(tiny_model_path, use_tqdm):
    import pty

    argument = "" if use_tqdm is None else f", use_tqdm={use_tqdm}"
    code = (f"from torpor import LLM, SamplingParams; llm = LLM({tiny_model_path!r}, device='cpu', max_model_len=64); "
            f"print(len(llm.generate(['a', 'b', 'c'], SamplingParams(max_tokens=2){argument})))")
    main, terminal = pty.openpty()
    process = subprocess.Popen([sys.executable, "-c", code], stderr=terminal, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": REPO})
    os.close(terminal)
    shown = b""
    with contextlib.suppress(OSError):  # EIO once the process has exited and its output is drained
        while chunk := os.read(main, 65536):
            shown += chunk
    os.close(main)
    printed = process.stdout.read()
    assert process.wait(timeout=120) == 0 and printed == "3\n", shown
    assert (b"Processed prompts" in shown and b"3/3" in shown) == (use_tqdm is None), shown


def test_collective_rpc_runs_engine_methods_by_name(llm):
    assert llm.collective_rpc("is_sleeping") == [False]
    assert llm.collective_rpc("sleep", args=(1,), kwargs={"mode": "wait"})[0] is not None
    assert llm.collective_rpc("is_sleeping") == [True]
    assert llm.collective_rpc("wake_up", kwargs={"tags": ["weights"]})[0].woken == ("weights", "runtime")
    [result] = llm.collective_rpc("wake_up")
    assert result.serving and llm.collective_rpc("memory_usage")[0]["level"] is None
    for method, args, kwargs, error in [
            ("rm -rf", (), None, "unknown collective_rpc method 'rm -rf'; supported: "),
            ("sleep", (), {"depth": 1}, "sleep: unknown argument 'depth'"),
            ("sleep", (1, "wait", 3), None, "sleep takes 2 argument\\(s\\)"),
            ("sleep", (), {"level": "1"}, "sleep: level must be int, got '1'"),
            ("sleep", (), {"level": 1, "mode": "later"}, "mode must be 'wait'"),
            ("wake_up", (), {"tags": "weights"}, "wake_up: tags must be list\\[str\\] | None"),
            ("is_sleeping", "x", None, "args must be a list or tuple")]:
        with pytest.raises(ValueError, match=error):
            llm.collective_rpc(method, args, kwargs)
        assert llm.collective_rpc("is_sleeping") == [False]  # a refused call changed nothing
    assert llm.generate(["Hello"], greedy())[0].outputs[0].token_ids  # still serving


def test_generation_config_defaults(tiny_model_path, tmp_path):
    path = tmp_path / "tiny"
    shutil.copytree(tiny_model_path, path)
    config_file = path / "generation_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "temperature": 0.0, "top_k": 20,
                                       "max_new_tokens": 5}))
    llm = LLM(str(path), **ENGINE)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_k=20, max_tokens=5)
    [out] = llm.generate(["Hello"])  # no params: the checkpoint's defaults (greedy, 5 tokens)
    assert len(out.outputs[0].token_ids) <= 5
    assert out.outputs[0].token_ids == llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=5))[
        0].outputs[0].token_ids
    ignored = LLM(str(path), generation_config="vllm", **ENGINE)
    assert ignored.get_default_sampling_params() == SamplingParams()
    elsewhere = LLM(tiny_model_path, generation_config=str(path), **ENGINE)
    assert elsewhere.get_default_sampling_params().max_tokens == 5
    with pytest.raises(ValueError, match=r"no generation_config\.json in"):
        LLM(tiny_model_path, generation_config=str(tmp_path / "nowhere"), **ENGINE)


@pytest.mark.parametrize("values, error", [
    ({"temperature": "hot"}, "temperature must be a finite number"),
    ({"top_p": 0}, "top_p must be in"),
    ({"max_new_tokens": -5}, "max_tokens must be >= 1"),
    ({"top_k": True}, "top_k must be an int"),
])
def test_generation_config_with_impossible_defaults_is_refused_at_once(tmp_path, values, error):
    """Not an error in every later request that leaves the field out: one ValueError naming the file."""
    (tmp_path / "generation_config.json").write_text(json.dumps(values))
    with pytest.raises(ValueError, match=rf"generation_config\.json: {error}"):
        generation_defaults(str(tmp_path), "unused")


def test_generation_config_top_k_0_means_no_top_k(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 0, "temperature": 0.7}))
    assert generation_defaults(str(tmp_path), "unused") == {"top_k": -1, "temperature": 0.7}


@pytest.mark.parametrize("name", ["~no-such-user-here/model", "a" * 300 + "/model"])
def test_names_the_file_system_cannot_look_up_are_not_found(name):
    """An unknown ~user (RuntimeError) or an over-long name (OSError ENAMETOOLONG) escaped as such."""
    with pytest.raises(FileNotFoundError, match="no such folder"):
        resolve_model(name)


def test_hub_ids_resolve_through_the_local_cache(tiny_model_path, tmp_path, monkeypatch, llm):
    cache = tmp_path / "hub"
    snapshot = fake_hub_cache(cache, tiny_model_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    hub = LLM("Org/Tiny", tokenizer="Org/Tiny", **ENGINE)
    assert hub.config.model == hub.config.tokenizer == str(snapshot)
    assert hub.generate(["Hello"], greedy())[0].outputs[0].token_ids == \
        llm.generate(["Hello"], greedy())[0].outputs[0].token_ids
    with pytest.raises(FileNotFoundError, match=f"no cached snapshot .* in {cache} \\(HF_HUB_OFFLINE is set\\)"):
        LLM("Org/Missing", **ENGINE)
    # a local folder wins over a Hub id of the same name
    local = tmp_path / "work" / "Org" / "Tiny"
    shutil.copytree(tiny_model_path, local)
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_model("Org/Tiny") == "Org/Tiny"
    with pytest.raises(FileNotFoundError, match="no such folder"):
        resolve_model("./Org/Missing")


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME"])
def test_hub_resolution_honours_the_environment(tiny_model_path, tmp_path, variable):
    """A fresh process: huggingface_hub reads HF_HOME / HF_HUB_CACHE / HF_HUB_OFFLINE itself."""
    cache = tmp_path / "hub"
    snapshot = fake_hub_cache(cache, tiny_model_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update({variable: str(cache if variable == "HF_HUB_CACHE" else tmp_path), "HF_HUB_OFFLINE": "1",
                "PYTHONPATH": REPO})
    code = ("from torpor.engine.model_path import resolve_model\nprint(resolve_model('Org/Tiny'))\n"
            "try:\n    resolve_model('Org/Other')\nexcept FileNotFoundError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    found, missing = out.stdout.splitlines()[:2]
    assert found == str(snapshot)
    assert "model 'Org/Other': no local folder of that name, and no cached snapshot" in missing
    assert f"in {cache} (HF_HUB_OFFLINE is set)" in missing
