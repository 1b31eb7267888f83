"""examples/colocated_grpo.py end to end on CPU: a trainer process and a `torpor serve` process, level-2
sleep, shared-memory weight pushes; the engine's logprobs must match the trainer's (fp32) after every push."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_colocated_grpo_example_on_cpu():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "colocated_grpo.py"), "--device", "cpu",
                             "--steps", "4"], capture_output=True, text=True, timeout=900,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 4, result.stdout
    for line in steps:  # every step pushed, woke and served again, and measured itself
        assert re.search(r"reward [\d.]+ \| mismatch max \S+ mean \S+ \| sleep \S+ s wake \S+ s push \S+ s", line)
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
