"""`torpor bench sleep` on CPU with the tiny model: each mode runs and writes well-formed output (its figures
mean something on a GPU only)."""

import json

import pytest

from torpor.cli.main import main

SMALL = ["--device", "cpu", "--max-num-seqs", "2", "--max-model-len", "64"]


def bench(capsys, tmp_path, *argv) -> tuple[dict, str]:
    out = tmp_path / "bench.json"
    assert main(["bench", "sleep", *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def positive(*values) -> bool:
    return all(isinstance(v, int | float) and v > 0 for v in values)


@pytest.mark.slow  # a cold start in a new process
def test_the_default_run(capsys, tmp_path, tiny_model_path):
    results, printed = bench(capsys, tmp_path, "--model", tiny_model_path, *SMALL, "--requests", "2",
                             "--soak-cycles", "1")
    assert list(results["sleep"]) == ["level1_first", "level1_resleep", "level1", "level2"]
    for row in results["sleep"].values():
        assert positive(row["sleep_s"], row["wake_s"], row["asleep_bytes"], row["awake_bytes"])
    assert positive(results["sleep"]["level2"]["reload_s"], results["weights"]["reload_warm_s"],
                    results["weights"]["reload_cold_s"], results["weights"]["level2_wake_reload"]["total_s"])
    cold = results["cold_start"]
    assert positive(cold["total_s"], cold["imports_s"], cold["first_token_s"])
    assert {"model_build", "kv_cache_sizing", "total"} <= cold["startup_phases"].keys()
    assert [h["mismatches"] for h in results["harness"]] == [0] * len(results["harness"])
    assert results["soak"]["exact"] == results["soak"]["cycles"] == 1
    for title in ("sleep and wake", "weights:", "cold start in a new process, by phase", "the bit-exact harness",
                  "soak: 1/1 cycles exact", "CPU smoke run: no goal"):
        assert title in printed
    assert "goal" not in printed.replace("no goal", "")  # no goal off the GPU it is for


@pytest.mark.slow  # three cold starts in new processes
def test_loader_only(capsys, tmp_path, tiny_model_path):
    results, printed = bench(capsys, tmp_path, "--loader-only", "--cold-starts", "1", "--model", tiny_model_path,
                             *SMALL)
    assert results["weights"]["answers_unchanged"] and positive(results["weights"]["reload_warm_s"])
    starts = results["cold_starts"]
    assert list(starts) == ["profiling the KV-sizing step", "the default, median of 1", "the default, page cache cold"]
    assert all(positive(s["total_s"], s["startup_phases"]["total"]) for s in starts.values())
    assert starts["profiling the KV-sizing step"]["options"]["kv_profile_cache"] is False
    assert "launch to first token" in printed and "reload_weights, page cache cold" in printed


def test_kv_curve(capsys, tmp_path, tiny_model_path):
    results, printed = bench(capsys, tmp_path, "--kv-curve", "--model", tiny_model_path, *SMALL)
    rows = results["kv_curve"]
    assert [r["gpu_memory_utilization"] for r in rows] == [0.15, 0.5, 0.85, 0.9]
    assert all(positive(r["kv_cache_bytes"], r["wake_s"], r["wake_weights_s"], r["wake_kv_cache_s"]) for r in rows)
    assert "level 1 by KV-cache size" in printed


def test_bad_counts_are_named(capsys):
    with pytest.raises(ValueError, match="--soak-cycles must be >= 1"):
        from torpor.cli.bench_sleep import run
        from torpor.cli.main import build_parser

        run(build_parser().parse_args(["bench", "sleep", "--device", "cpu", "--soak-cycles", "0"]))
