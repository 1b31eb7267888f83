"""The engine's commands: `torpor make-model`, and `torpor bench decode` as a CPU smoke test (its numbers
only mean something on a GPU, but every code path except CUDA graphs runs)."""

import json

import pytest

from torpor.cli.main import main
from torpor.synthetic import make_model


def test_make_model_writes_the_same_checkpoint_as_the_library(tmp_path, capsys):
    assert main(["make-model", "tiny-llama", str(tmp_path / "cli"), "--seed", "3", "--dtype", "float32"]) == 0
    assert "wrote" in capsys.readouterr().out
    make_model("tiny-llama", tmp_path / "lib", seed=3, dtype="float32", progress=False)
    files = sorted(p.name for p in (tmp_path / "lib").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "cli").iterdir())
    for name in files:
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "lib" / name).read_bytes(), name
    with pytest.raises(SystemExit):
        main(["make-model", "no-such-preset", str(tmp_path / "x")])


def test_bench_decode_runs_end_to_end_on_cpu(tmp_path, capsys):
    import transformers  # noqa: F401 - required by these tests
    out = tmp_path / "bench.json"
    argv = ["bench", "decode", "--device", "cpu", "--models", "tiny", "--throughput-model", "tiny-qwen2",
            "--cache-dir", str(tmp_path / "models"), "--prompt-len", "8", "--decode-tokens", "8",
            "--num-requests", "6", "--prompt-lens", "4,12", "--output-lens", "2,6", "--max-num-seqs", "4",
            "--hf-batch-size", "4", "--copy-gib", "0.01", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "batch-1 greedy decode" in printed and "tiny-qwen2 throughput" in printed and "CPU smoke run" in printed
    results = json.loads(out.read_text())
    (batch1,) = results["batch1"]
    assert results["copy_gbps"] > 0 and batch1["model"] == "tiny"
    assert batch1["tokens_per_s"] > 0 and batch1["bytes_per_step"] > 0 and batch1["device_step_s"] is None
    throughput = results["throughput"]
    assert throughput["output_tokens"] > 0 and throughput["ratio"] > 0


def test_bench_decode_at_two_ranks_and_after_a_sleep_on_cpu(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "decode", "--device", "cpu", "--models", "tiny", "--throughput-model", "tiny",
            "--cache-dir", str(tmp_path / "models"), "--prompt-len", "8", "--decode-tokens", "8",
            "--num-requests", "6", "--prompt-lens", "4,12", "--output-lens", "2,6", "--max-num-seqs", "4",
            "--no-hf", "--copy-gib", "0.01", "--tensor-parallel-size", "2", "--sleep-cycle", "--json", str(out)]
    assert main(argv) == 0
    assert "TP=2" in capsys.readouterr().out
    results = json.loads(out.read_text())
    assert results["tensor_parallel_size"] == 2 and results["batch1"][0]["after_sleep_tokens_per_s"] > 0
    assert results["throughput"]["engine_tokens_per_s"] > 0
