"""examples/colocated_grpo.py end to end on CPU, with its documented command: a trainer process and a `torpor
serve` process, level-2 sleep, shared-memory weight pushes. The policy learns visibly (the mean reward of the last
two steps at least 0.2 above the first step's) and the engine's logprobs match the trainer's (fp32) after every
push, the mismatch line last."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_colocated_grpo_example_learns_on_cpu(tmp_path):
    plot = tmp_path / "reward.png"
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "colocated_grpo.py"), "--device", "cpu",
                             "--plot", str(plot)], capture_output=True, text=True, timeout=900,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 8, result.stdout  # the documented command: 8 steps
    for line in steps:  # every step pushed, woke and served again, and measured itself
        assert re.search(r"reward [\d.]+ \| mismatch max \S+ mean \S+ \| sleep \S+ m?s wake \S+ m?s push \S+ m?s", line)
    rewards = [float(re.search(r"reward ([\d.]+)", line).group(1)) for line in steps]
    assert (rewards[-1] + rewards[-2]) / 2 >= rewards[0] + 0.2, result.stdout  # it learns, visibly
    assert "reward per step (0 to 1):" in result.stdout and plot.read_bytes()[:4] == b"\x89PNG"
    match = re.fullmatch(r"train-inference max \|logprob diff\| (\S+)", lines[-1])
    assert match, lines[-1]
    assert float(match.group(1)) <= 1e-4  # the weights the engine sampled with are the trainer's, every step


@pytest.mark.slow
def test_colocated_grpo_example_with_a_mixture_of_experts():
    """tiny-moe: the trainer is transformers' Qwen3MoeForCausalLM, whose named_parameters() hold the experts fused;
    the engine takes them as they are."""
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "colocated_grpo.py"), "--device", "cpu",
                             "--preset", "tiny-moe", "--steps", "2"], capture_output=True, text=True, timeout=900,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    assert len([line for line in lines if line.startswith("step ")]) == 2, result.stdout
    match = re.fullmatch(r"train-inference max \|logprob diff\| (\S+)", lines[-1])
    assert match, lines[-1]
    assert float(match.group(1)) <= 1e-4
