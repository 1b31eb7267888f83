"""Start-up (issue 16): what a new process imports to start an engine, and the garbage collector paused
meanwhile (torpor/lazy.py)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap

import pytest

from torpor.lazy import collector_paused

# Not needed to start an engine and answer: imported where they are used (the server, chat templates, Hub
# downloads, torch.compile's machinery, the plain loader's safetensors reader, the checkpoint generator).
NOT_AT_START = ("torch._dynamo", "torch._inductor", "sympy", "transformers", "jinja2", "huggingface_hub", "rich",
                "fastapi", "pydantic", "uvicorn", "safetensors", "triton", "torpor.server", "torpor.engine.checkpoint",
                "torpor.engine.weight_transfer", "torpor.engine.sleep_harness")


def test_the_collector_is_paused_inside_and_restored_after():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # until the outermost block ends
    assert gc.isenabled()
    with pytest.raises(KeyError), collector_paused():
        raise KeyError("a failed start-up")
    assert gc.isenabled()


def test_a_collector_the_program_turned_off_stays_off():
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_collector_paused_is_a_decorator():
    @collector_paused()
    def build() -> bool:
        return gc.isenabled()

    assert build() is False and build() is False
    assert gc.isenabled()


def test_a_cpu_engine_starts_and_answers_without_the_heavy_imports(tiny_model_path):
    """A new process: `from torpor import LLM, SamplingParams`, an engine, a first token; then which of
    NOT_AT_START it imported, and the collector's state."""
    code = textwrap.dedent(f"""
        import gc, json, sys
        import torch
        from torpor import LLM, SamplingParams
        llm = LLM({tiny_model_path!r}, device="cpu", max_num_seqs=4, max_model_len=128)
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))
        print(json.dumps(dict(tokens=len(out[0].outputs[0].token_ids), gc=gc.isenabled(),
                              imported=[m for m in {NOT_AT_START!r} if m in sys.modules])))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == dict(tokens=2, gc=True, imported=[])
