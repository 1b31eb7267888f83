"""examples/ray_grpo.py end to end on CPU: a trainer actor and a 2-replica fleet on a local Ray cluster, level-2
sleep, weights over one gloo group to both replicas; the engines' logprobs must match the trainer's (fp32)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[2]


def test_ray_grpo_example_on_cpu():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "ray_grpo.py"), "--device", "cpu", "--replicas",
                             "2", "--steps", "3", "--prompts", "2"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 3, result.stdout
    for i, line in enumerate(steps, 1):  # every step pushed, woke and served again, measured, moved the version
        assert re.search(r"reward [\d.]+ \| mismatch max \S+ mean \S+ \| sleep \S+ s wake \S+ s push \S+ s rollout "
                         rf"\S+ s train \S+ s \| weight version {i}$", line), line
    match = re.fullmatch(r"train-inference max \|logprob diff\| (\S+)", lines[-1])
    assert match, lines[-1]
    assert float(match.group(1)) <= 1e-4  # the weights every replica sampled with are the trainer's, every step
