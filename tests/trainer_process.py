"""A trainer process for the GPU weight-push tests: a Python snippet run in a child process (the repository on
its path), its stderr kept in a temporary file for the assertion messages; and the two tiny checkpoints
(seeds 0 and 1: the engine's weights and the trainer's new ones) those tests push between."""

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from torpor.synthetic import make_model

ROOT = Path(__file__).resolve().parents[1]


def start_trainer(code: str, *args: str) -> subprocess.Popen:
    """`code` (dedented) run by a new interpreter with `args` as its argv; stdin and stdout are text pipes."""
    err = tempfile.TemporaryFile("w+")  # noqa: SIM115 (read by stderr_of, closed with the process)
    process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    process.err_file = err
    return process


def stderr_of(process: subprocess.Popen) -> str:
    """What the trainer wrote to stderr so far."""
    process.err_file.seek(0)
    return process.err_file.read()


def tiny_checkpoints(root: Path) -> dict[int, str]:
    """The tiny preset in bfloat16 with seeds 0 and 1, under `root`."""
    return {seed: str(make_model("tiny", root / f"seed{seed}", seed=seed, dtype="bfloat16", progress=False))
            for seed in (0, 1)}
