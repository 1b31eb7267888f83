"""Real chat templates (Qwen3, Llama 3.1; tests/data/chat_templates) render with torpor's Jinja environment to
the strings the models expect, and to what transformers' own renderer produces; template failures are
ChatTemplateErrors naming the template's error."""

from datetime import datetime
from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from torpor.engine.chat_template import ChatTemplateError, load_chat_template, render_chat

DATA = Path(__file__).parent.parent / "data" / "chat_templates"
QWEN3 = (DATA / "qwen3-0.6b.jinja").read_text()
LLAMA31 = (DATA / "llama-3.1-8b-instruct.jinja").read_text()
LLAMA_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
QWEN_TOKENS = {"bos_token": "", "eos_token": "<|im_end|>"}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a 'city' <now> & später",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "Hi"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    "multi turn with reasoning": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"}],
    "tool call and result": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny, 21 °C"}],
}


def test_qwen3_renders_the_known_prompt():
    messages = CONVERSATIONS["system"]
    assert render_chat(QWEN3, messages, **QWEN_TOKENS) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert render_chat(QWEN3, messages, enable_thinking=False, **QWEN_TOKENS).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # an earlier assistant turn loses its reasoning (the template splits it off at </think>)
    assert render_chat(QWEN3, CONVERSATIONS["multi turn with reasoning"], **QWEN_TOKENS) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n")


def test_qwen3_tools_use_hugging_faces_tojson():
    text = render_chat(QWEN3, CONVERSATIONS["one turn"], tools=[WEATHER_TOOL], **QWEN_TOKENS)
    # HF's tojson: no HTML escaping of ' < > &, non-ASCII kept, keys in insertion order
    assert ('{"type": "function", "function": {"name": "get_weather", "description": '
            '"Weather in a \'city\' <now> & später"') in text


def test_llama31_renders_the_known_prompt():
    assert render_chat(LLAMA31, [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Hi"}],
                       **LLAMA_TOKENS) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    dated = render_chat(LLAMA31, CONVERSATIONS["one turn"], date_string="01 Dec 2026", **LLAMA_TOKENS)
    assert "Today Date: 01 Dec 2026\n" in dated


def test_llama31_tools_indent_and_raise_exception():
    text = render_chat(LLAMA31, CONVERSATIONS["one turn"], tools=[WEATHER_TOOL], **LLAMA_TOKENS)
    assert '{\n    "type": "function",\n    "function": {\n        "name": "get_weather",' in text  # tojson(indent=4)
    with pytest.raises(ChatTemplateError, match="no first user message"):  # the template's raise_exception
        render_chat(LLAMA31, [{"role": "system", "content": "s"}], tools=[WEATHER_TOOL], **LLAMA_TOKENS)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("template", ["qwen3", "llama31"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_same_text_as_transformers(template, name, add_generation_prompt):
    source, tokens = (QWEN3, QWEN_TOKENS) if template == "qwen3" else (LLAMA31, LLAMA_TOKENS)
    messages = CONVERSATIONS[name]
    tools = [WEATHER_TOOL] if "tool" in name else None
    expected = render_jinja_template([messages], tools=tools, chat_template=source,
                                     add_generation_prompt=add_generation_prompt, **tokens)[0][0]
    assert render_chat(source, messages, add_generation_prompt, tools=tools, **tokens) == expected


@pytest.mark.parametrize("source", [QWEN3, LLAMA31])
def test_continue_final_message_matches_transformers(source):
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    expected = render_jinja_template([messages], chat_template=source, continue_final_message=True, **LLAMA_TOKENS)
    text = render_chat(source, messages, add_generation_prompt=False, continue_final_message=True, **LLAMA_TOKENS)
    assert text == expected[0][0] and text.endswith("The colour is")
    with pytest.raises(ValueError, match="cannot both be true"):
        render_chat(source, messages, add_generation_prompt=True, continue_final_message=True)


def test_environment_has_loopcontrols_strftime_now_and_content_parts():
    template = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
             {"role": "user", "content": "never"}]
    assert render_chat(template, parts) == "ab"
    assert render_chat("{{ strftime_now('%Y') }}", parts) == str(datetime.now().year)
    assert render_chat("{% generation %}x{% endgeneration %}", parts) == "x"
    with pytest.raises(ValueError, match="image_url"):
        render_chat(template, [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}])


@pytest.mark.parametrize("source, error", [
    ("{{ messages[0].content.__class__.__mro__ }}", "unsafe"),  # the sandbox holds
    ("{% set ns = namespace(_x=1) %}", "SecurityError"),
    ("{{ 1 + 'a' }}", "TypeError"),
    ("{% for %}", "does not compile"),
])
def test_template_failures_name_the_error(source, error):
    with pytest.raises(ChatTemplateError, match=error):
        render_chat(source, CONVERSATIONS["one turn"])


def test_load_chat_template_file_or_inline(tmp_path):
    file = tmp_path / "t.jinja"
    file.write_text(QWEN3)
    assert load_chat_template(str(file)) == QWEN3
    assert load_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(ValueError, match="neither a file nor Jinja"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        load_chat_template("{% if %}")


# ---- tokenizer files of a checkpoint folder -------------------------------------------------------
@pytest.mark.parametrize("file, text, error", [
    ("tokenizer_config.json", "[1]", r"not a JSON object \(a list\)"),
    ("tokenizer_config.json", "[" * 100_000, "nested too deeply"),
    ("tokenizer_config.json", "{broken", "Expecting property name"),
    ("tokenizer_config.json", '{"chat_template": [1, 2]}', "chat_template must be a template or a list"),
    ("tokenizer_config.json", '{"chat_template": 7}', "chat_template must be a template or a list"),
    ("tokenizer_config.json", '{"bos_token": [1]}', "bos_token must be a string"),
    ("tokenizer.json", "{broken", "not a tokenizers file"),
])
def test_malformed_tokenizer_files_name_the_file(tiny_model_path, tmp_path, file, text, error):
    """Each a ValueError naming the file, not an AttributeError, RecursionError or the library's bare Exception."""
    from torpor.engine.tokenizer import Tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((Path(tiny_model_path) / name).read_bytes())
    (tmp_path / file).write_text(text)
    with pytest.raises(ValueError, match=rf"{file}: {error}"):
        Tokenizer.from_pretrained(tmp_path)
