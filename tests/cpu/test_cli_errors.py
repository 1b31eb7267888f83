"""The `torpor` command's errors: one clean line on stderr and a non-zero exit, never a traceback;
`--plot` is checked before the demo runs; a misspelled option is named by its subcommand with the option meant.
And `torpor --version`."""

from __future__ import annotations

import time

import pytest
import torch

from torpor.cli.main import main


def one_line_error(capsys, argv: list[str], expect: str) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith(f"torpor {argv[0]}") and expect in err, err
    return err


def test_demo_with_a_missing_model(capsys):
    one_line_error(capsys, ["demo", "--device", "cpu", "--model", "/nope", "--plot", ""], "/nope")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_demo_on_cuda_without_cuda(capsys):
    one_line_error(capsys, ["demo", "--device", "cuda", "--plot", ""], "CUDA is not available")


@pytest.mark.parametrize("plot, expect", [("/nonexistent/x.png", "does not exist"), ("plot.txt", ".png")])
def test_demo_checks_the_plot_path_before_running(capsys, tiny_model_path, plot, expect):
    start = time.monotonic()
    one_line_error(capsys, ["demo", "--device", "cpu", "--model", tiny_model_path, "--plot", plot], expect)
    assert time.monotonic() - start < 3  # refused up front, not after the whole demo
    assert "engine on" not in capsys.readouterr().out


def test_make_model_into_an_existing_file(capsys, tmp_path):
    existing = tmp_path / "file"
    existing.write_text("keep me")
    one_line_error(capsys, ["make-model", "tiny", str(existing)], "not a folder")
    assert existing.read_text() == "keep me"


def test_bench_sleep_with_a_missing_model(capsys):
    err = one_line_error(capsys, ["bench", "sleep", "--device", "cpu", "--model", "/nope"], "/nope")
    assert err.startswith("torpor bench sleep: error:")


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("torpor ")


@pytest.mark.parametrize("argv, usage, unknown, meant", [
    (["demo", "--devcie", "cpu"], "usage: torpor demo", "--devcie cpu", "--device"),
    (["bench", "sleep", "--requets", "3"], "usage: torpor bench sleep", "--requets 3", "--requests"),
    (["serve", "--admin-tokn=x"], "usage: torpor serve", "--admin-tokn=x", "--admin-token"),
])
def test_a_misspelled_option_is_named_by_its_command_with_the_one_meant(capsys, argv, usage, unknown, meant):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert f"error: unrecognized arguments: {unknown} (did you mean {meant}?)" in err, err


def test_demo_with_a_preset_name_says_how_to_make_it(capsys):
    one_line_error(capsys, ["demo", "--device", "cpu", "--model", "qwen3-0.6b", "--plot", ""],
                   "torpor make-model qwen3-0.6b ./qwen3-0.6b")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("bench", ["decode", "sleep", "memory"])
def test_bench_on_cuda_without_cuda(capsys, monkeypatch, bench):
    import torpor.synthetic

    monkeypatch.setattr(torpor.synthetic, "cached_model_path", lambda *a, **k: pytest.fail("a checkpoint was written"))
    err = one_line_error(capsys, ["bench", bench, "--device", "cuda"], "CUDA is not available")
    assert err.startswith(f"torpor bench {bench}: error:")


def test_bench_generate_defaults_to_the_tiny_model_on_cpu(capsys, monkeypatch):
    import torpor.synthetic

    asked = []

    def cached_model_path(preset, **options):
        asked.append(preset)
        raise OSError("stop here")

    monkeypatch.setattr(torpor.synthetic, "cached_model_path", cached_model_path)
    one_line_error(capsys, ["bench", "generate", "--device", "cpu"], "stop here")
    assert asked == ["tiny"]  # not qwen3-0.6b: 1.2 GB written and a GPU-sized workload on the CPU
