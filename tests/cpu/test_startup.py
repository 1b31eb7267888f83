"""Start-up: what a new process imports to start an engine, and the garbage collector paused
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
                "fastapi", "pydantic", "uvicorn", "safetensors", "triton", "torpor.server", "torpor.synthetic",
                "torpor.testing.harness")


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


def test_triton_hashes_its_installation_on_the_warming_thread_not_at_the_first_launch():
    """`warm_triton_cache_key` (started by a GPU start-up beside the model build and the weight load) leaves
    Triton's key of its own installation computed: the first kernel launch finds it cached, not recomputed."""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        from torpor.engine.lazy_jit import warm_triton_cache_key
        thread = warm_triton_cache_key()
        assert thread.name.startswith("torpor-") and thread.daemon
        thread.join()
        import triton.runtime.cache as cache
        before = cache.triton_key.cache_info()
        cache.triton_key()  # what a launch's cache lookup (get_cache_key) calls first
        after = cache.triton_key.cache_info()
        print(before.misses, before.currsize, after.misses, after.hits - before.hits)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1", "1", "1"]  # computed once, on the thread; the later call a hit
