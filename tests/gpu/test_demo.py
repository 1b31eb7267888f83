"""`torpor demo` on a GPU (the main job): the qwen3-0.6b geometry with synthetic weights, said so,
GiB moved at tens of GB/s, every answer bit-identical, the plot where it was asked for."""

import os
import re
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_demo_on_the_gpu_moves_gib_at_link_speed(tmp_path):
    plot = tmp_path / "plot.png"
    result = subprocess.run([sys.executable, "-m", "torpor", "demo", "--plot", str(plot)], capture_output=True,
                            text=True, timeout=600, env={**os.environ, "COLUMNS": "220"})
    out = result.stdout
    print(out[-6000:])
    assert result.returncode == 0, out + result.stderr
    assert "qwen3-0.6b" in out and "the weights are synthetic" in out
    assert out.count("bit-identical") == 4
    cells = re.findall(r"([\d.]+) (GiB|MiB), ([\d.]+) GB/s", out)  # "25 ms, 1.12 GiB, 47.3 GB/s"
    moved = [float(size) / (1 if unit == "GiB" else 1024) for size, unit, _ in cells]
    rates = [float(rate) for _, _, rate in cells]
    assert moved and max(moved) >= 0.5, out  # a real geometry: GiB, not the tiny model's MiB
    assert max(rates) >= 10, out  # tens of GB/s over the host link
    assert f"memory plot written to {plot}" in out and plot.read_bytes()[:4] == b"\x89PNG"
