"""`torpor demo`, the README's main job, end to end on CPU."""

import os
import subprocess
import sys

import pytest


@pytest.mark.slow  # a subprocess
def test_demo_checks_every_answer_and_writes_the_plot(tiny_model_path, tmp_path):
    plot = tmp_path / "memory.png"
    result = subprocess.run([sys.executable, "-m", "torpor", "demo", "--device", "cpu", "--model", tiny_model_path,
                             "--plot", str(plot)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("bit-identical") == 4  # three cycles and the closing line
    assert "every answer bit-identical to the first" in result.stdout
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # a subprocess
def test_bench_sleep_runs_the_harness_and_the_soak(tiny_model_path, tmp_path):
    out = tmp_path / "sleep.json"
    result = subprocess.run([sys.executable, "-m", "torpor", "bench", "sleep", "--device", "cpu", "--model",
                             tiny_model_path, "--requests", "8", "--soak-cycles", "4", "--max-num-seqs", "4",
                             "--max-model-len", "256", "--json", str(out)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    import json

    report = json.loads(out.read_text())
    assert [h["mismatches"] for h in report["harness"]] == [0] * 6
    assert report["soak"] == report["soak"] | {"cycles": 4, "exact": 4}
    assert report["level1"]["tags"].keys() >= {"weights", "kv_cache", "runtime"}
    assert "runtime" not in report["untagged_runtime"]["tags"]
