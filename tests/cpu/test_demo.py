"""`torpor demo`, the README's main job, end to end on CPU."""

import os
import re
import subprocess
import sys

import pytest

from torpor.cli.main import main


def run_demo(args: list[str], env: dict) -> list[str]:
    result = subprocess.run([sys.executable, "-m", "torpor", "demo", "--device", "cpu", *args], capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not result.stderr.strip(), result.stderr  # no warnings between the lines
    return result.stdout.splitlines()


@pytest.mark.slow  # subprocesses
def test_demo_checks_every_answer_in_80_columns_and_writes_the_plot(tiny_model_path, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    for columns in ("80", None):  # a terminal of 80 columns; a pipe (no COLUMNS)
        cache = tmp_path / f"cache-{columns}"
        lines = run_demo(["--model", tiny_model_path], {**env, "TORPOR_CACHE": str(cache),
                                                        **({"COLUMNS": columns} if columns else {})})
        assert max(len(line) for line in lines) <= 80, "\n".join(lines)
        rows = [line for line in lines if line.lstrip().startswith("sleep(")]
        assert len(rows) == 3 and all(row.rstrip().endswith("same") for row in rows), "\n".join(lines)
        for row in rows:  # the tags' tensors leave the device while asleep and come back: "X → 0 → X"
            awake, asleep, woken = re.search(r"([\d.]+) → ([\d.]+) → ([\d.]+)", row).groups()
            assert float(awake) > 0 and float(asleep) == 0 and woken == awake, row
        assert lines[-1] == "every answer bit-identical to the first"
        plot = cache / "torpor-demo-memory.png"  # by default into the cache folder, not the current one
        told = "".join(lines[next(i for i, line in enumerate(lines) if line.startswith("memory plot")):-1])
        assert told.replace(" ", "") == f"memoryplotwrittento{plot}"  # (folded at 80 columns)
        assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_wide_shows_every_tag_the_host_copies_and_the_rates(tiny_model_path, capsys):
    assert main(["demo", "--device", "cpu", "--model", tiny_model_path, "--wide", "--plot", ""]) == 0
    text = capsys.readouterr().out
    for header in ("weights, KiB", "runtime, KiB", "kv_cache, MiB", "host copies", "in use (RSS), MiB"):
        assert header in text, text
    assert text.count("bit-identical") == 4 and re.search(r"KiB, [\d.]+ [kMG]B/s", text), text
    assert "0.00 GB/s" not in text and "{" not in text
