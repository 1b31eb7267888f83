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
