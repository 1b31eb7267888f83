"""`torpor bench sleep --loader-only` on CPU: the reload rows (plain and staged, page cache warm and cold),
level-2 wake + reload, and a cold start in a new process split into its phases."""

import json
import subprocess
import sys

import pytest

from torpor.cli.bench_sleep import STAGING_SWEEP


@pytest.mark.slow
def test_bench_sleep_loader_rows(tiny_model_path, tmp_path):
    out = tmp_path / "loader.json"
    result = subprocess.run([sys.executable, "-m", "torpor", "bench", "sleep", "--loader-only", "--device", "cpu",
                             "--model", tiny_model_path, "--max-num-seqs", "4", "--max-model-len", "256",
                             "--cold-start-rounds", "1", "--json", str(out)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    loader = report["loader"]
    assert set(loader["reload"]) == {"old_warm", "new_warm", "old_cold", "new_cold"}
    assert all(row["seconds"] > 0 and row["gbps"] > 0 for row in loader["reload"].values())
    assert loader["answers_unchanged"] and loader["level2_wake_reload"]["reload_s"] > 0
    sweep = loader["staging_sweep"]  # the staged reload with other buffer sets, to choose the default from
    assert [(row["buffers"], row["mib"]) for row in sweep.values()] == list(STAGING_SWEEP)  # the default first
    assert all(row["gbps"] > 0 and row["threads"] >= 1 for row in sweep.values())
    phases = report["cold_start_phases"]["phases"]
    assert {"imports", "model_build", "weight_load", "kv_cache_sizing", "kv_cache_allocation", "engine_other",
            "first_token"} <= phases.keys()
    assert report["cold_start_phases"]["weight_load_beside_s"] is None and "weight_load_wait" not in phases
    overlapped = report["cold_start_phases_overlapped"]  # TORPOR_OVERLAP_LOAD=1, side by side
    assert {"weight_load_plan", "kv_cache_sizing", "weight_load_wait"} <= overlapped["phases"].keys()
    assert "weight_load" not in overlapped["phases"] and overlapped["weight_load_beside_s"] > 0
    assert "staged (torpor)" in result.stdout and "cold start in a new process" in result.stdout
    assert "the weights loaded beside the KV sizing" in result.stdout
    for key in ("cold_start_phases_cold_cache", "cold_start_phases_cold_cache_overlapped",  # page cache dropped
                "cold_start_phases_one_warmup", "cold_start_phases_default"):  # one warm-up (no graphs on CPU)
        assert report[key]["total_s"] > 0 and report[key]["phases"]["first_token"] > 0
    assert {"imports", "weight_load", "kv_cache_sizing"} <= report["cold_start_phases_profiling"]["phases"].keys()
    assert report["cold_start_phases"]["graph_capture"] == []  # per batch size on GPU; no graphs on CPU
    alternated = report["cold_start_alternated"]  # the old path, beside, the default (beside with one warm-up)
    assert [len(runs) for runs in alternated.values()] == [1, 1, 1] and "alternated: median" in result.stdout
    assert "weight_load_wait" in alternated["overlapped"][-1]["phases"]
    assert "weight_load_wait" in report["cold_start_phases_default"]["phases"]
    assert "the default (loaded beside, one warm-up), alternated: median" in result.stdout
    profile = report["cold_start_phases_profiled"]["profile"]  # pstats' table of the start-up, by own time
    assert any("tottime" in line for line in profile) and any("{built-in method" in line for line in profile)
