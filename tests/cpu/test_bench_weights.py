"""`torpor bench weights` on CPU (tiny model): a real `torpor serve` engine, pushes from this process through
shared memory with 1 and 2 requests in flight, the RL-step cycle, and the side-by-side figures, written to JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_weights_on_cpu(tmp_path, tiny_model_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "torpor", "bench", "weights", "--device", "cpu", "--model",
                             tiny_model_path, "--repeat", "1", "--bucket-mb", "1", "--in-flight", "1,2", "--json",
                             str(out)],
                            capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(out.read_text())
    serve = results["serve"]
    assert serve["answers_unchanged"]  # the same weights pushed back (and after the RL cycle) answer the same
    assert serve["push_s"] > 0 and serve["push_one_request_s"] > 0 and serve["reload_weights_s"] > 0
    assert set(serve["rl_step"]) == {"sleep", "wake_weights", "push", "wake_kv", "total"}
    step_push = serve["rl_step_push"]  # the RL step's push (right after the wake) by phase, beside the others'
    assert step_push["push_s"] == serve["rl_step"]["push"] and "copy" in step_push["push_phases_ms_per_request"]
    assert "serve push in the RL step (right after the weights' wake)" in result.stdout
    assert set(serve["by_in_flight"]) == {"1", "2"} and serve["in_flight"] == 2  # depths side by side
    for figures in serve["by_in_flight"].values():
        assert {"engine", "other", "idle", "handler", "push", "copy"} <= set(figures["push_phases_ms_per_request"])
        trainer = figures["trainer_ms_per_request"]  # this process's side: where the idle time goes
        assert set(trainer) == {"bucket", "sync", "serialize", "wait"} and trainer["bucket"] > 0 < trainer["wait"]
    assert serve["own_buckets"]["push_s"] > 0 and "buckets of their own" in result.stdout  # beside the ring's
    assert "1 in flight" in result.stdout and "2 in flight" in result.stdout
    assert results["in_process"]["update_weights_s"] > 0
    assert "RL step: sleep L2" in result.stdout
