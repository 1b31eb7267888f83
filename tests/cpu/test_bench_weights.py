"""`torpor bench weights` on CPU (tiny model): a real `torpor serve` engine, pushes from this process through
shared memory with 1 and 2 requests in flight, the RL step and the side-by-side figures, written to JSON."""

import json

import pytest

from torpor.cli.main import main


@pytest.mark.slow  # a `torpor serve` process
def test_bench_weights_on_cpu(tmp_path, tiny_model_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "weights", "--device", "cpu", "--model", tiny_model_path, "--repeat", "1", "--bucket-mb",
                 "0.25", "--in-flight", "1,2", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    serve = results["serve"]
    assert serve["answers_unchanged"] and serve["in_flight"] == 2 and set(serve["by_in_flight"]) == {"1", "2"}
    for figures in (*serve["by_in_flight"].values(), serve["own_buckets"], serve["one_request"]):
        assert figures["push_s"] > 0 and figures["requests"] >= 1 and "copy" in figures["engine_phases_s_per_request"]
    assert set(serve["rl_step"]) == {"sleep_s", "wake_weights_s", "push_s", "wake_kv_cache_s", "total_s"}
    assert serve["reload_weights_s"] > 0 and results["in_process"]["update_weights_from_tensor_s"] > 0
    printed = capsys.readouterr().out
    for title in ("push from the trainer process", "per request: the engine's phases", "the RL step"):
        assert title in printed


@pytest.mark.slow  # a `torpor serve` process
def test_bench_weights_four_phase_on_cpu(tmp_path, tiny_model_path, capsys):
    out = tmp_path / "four-phase.json"
    assert main(["bench", "weights", "--device", "cpu", "--model", tiny_model_path, "--repeat", "1", "--bucket-mb",
                 "0.25", "--four-phase", "--json", str(out)]) == 0
    four = json.loads(out.read_text())["four_phase"]
    assert four["answers_unchanged"] and four["packed_chunks"] >= 2
    assert all(four[k]["s"] > 0 and four[k]["gbps"] > 0 for k in ("unpacked", "packed", "from_tensor"))
    assert "vLLM's four-phase update (ipc) beside update_weights_from_tensor" in capsys.readouterr().out
