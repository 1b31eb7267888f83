"""`torpor serve`: its help, its exit codes, and a whole run in a subprocess (start-up progress, serving,
the control plane from the environment's admin token, a clean stop on SIGTERM); the same with
`--tensor-parallel-size 2` (two CPU processes over gloo): answers equal to one process, sleep and wake
over HTTP on every rank, and the worker gone after the stop."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import uvicorn  # noqa: F401 - required by these tests

from torpor.cli.main import main


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for option in ("--host", "--port", "--device", "--dtype", "--max-model-len", "--max-num-seqs",
                   "--tensor-parallel-size", "--admin-token", "--allowed-weights-dir",
                   "--api-key", "--max-body-bytes", "--max-tokens-cap", "--asleep-timeout", "TORPOR_ADMIN_TOKEN",
                   "--max-prompts-per-request", "--tool-call-parser", "--enable-auto-tool-choice", "/generate",
                   "/sleep", "/wake_up", "exit codes"):
        assert option in text, option


def test_exit_codes(tmp_path, tiny_model_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--port", "70000"])
    assert exited.value.code == 2
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", tiny_model_path, "--device", "cpu", "--port", str(port)]) == 3
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert main(["serve", str(tmp_path / "missing"), "--device", "cpu", "--port", "0"]) == 1
    assert "the engine could not start" in capsys.readouterr().err
    # `--admin-token "$TOKEN"` with TOKEN unset would serve with the control plane off (an empty --api-key: open)
    for option in ("--admin-token", "--api-key"):
        assert main(["serve", tiny_model_path, "--device", "cpu", "--port", "0", option, " "]) == 2
        err = capsys.readouterr().err
        assert f"{option} is empty" in err and "loading" not in err


def start_server(argv: list[str], env: dict) -> tuple[subprocess.Popen, str, list[str]]:
    """`python -m torpor serve ARGV`, once it serves: (process, its URL, its start-up lines)."""
    process = subprocess.Popen([sys.executable, "-m", "torpor", "serve", *argv], env=env, stderr=subprocess.PIPE,
                               text=True)
    lines = []
    deadline = time.monotonic() + 60
    while not any("serving" in line for line in lines):
        line = process.stderr.readline()
        if not line or time.monotonic() > deadline:
            process.kill()
            raise AssertionError("the server did not start:\n" + "".join(lines) + process.stderr.read())
        lines.append(line)
    return process, re.search(r"http://[\d.]+:\d+", lines[-1]).group(0), lines


def stop_server(process: subprocess.Popen) -> str:
    """SIGTERM; asserts a clean exit; returns the rest of its output."""
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    return process.stderr.read()


@pytest.mark.slow  # a subprocess
def test_serve_runs_and_stops_cleanly_on_sigterm(tiny_model_path, tmp_path):
    env = {**os.environ, "TORPOR_ADMIN_TOKEN": "from-env", "TORPOR_API_KEY": ""}
    argv = [tiny_model_path, "--device", "cpu", "--port", "0", "--max-model-len", "64", "--max-num-seqs", "4",
            "--served-model-name", "tiny", "--log-level", "warning", "--allowed-weights-dir", str(tmp_path)]
    process, url, lines = start_server(argv, env)
    try:
        assert any("loading" in line for line in lines) and any("engine ready" in line for line in lines)
        assert not any(", auto," in line for line in lines)  # the dtype the engine runs in, not "auto"
        assert "control plane: on" in lines[-1]
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.get("/health").json()["status"] == "ok"
            answer = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3})
            assert answer.json()["usage"]["completion_tokens"] >= 1
            admin = {"Authorization": "Bearer from-env"}
            outside = http.post("/reload_weights", json={"path": tiny_model_path}, headers=admin)  # not in tmp_path
            assert outside.status_code == 403 and outside.json()["error"]["code"] == "path_not_allowed"
            assert http.post("/reload_weights", headers=admin).json()["serving"]  # the served model: always
            slept = http.post("/sleep", params={"level": 1}, headers=admin)
            assert slept.json()["is_sleeping"] is True
        assert "stopped" in stop_server(process)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow  # a subprocess
def test_plain_serve_announces_once_it_accepts_connections_and_serves_the_tiny_model_as_tiny():
    """A launch script that waits for the "serving ... on http://..." line connects at once, with no retry,
    while every other core is busy; the embedded model is served as "tiny", whatever its cache folder."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range((os.cpu_count() or 2) - 1)]
    env = {**os.environ, "TORPOR_ADMIN_TOKEN": "", "TORPOR_API_KEY": ""}
    process = subprocess.Popen([sys.executable, "-m", "torpor", "serve", "--device", "cpu", "--port", "0",
                                "--max-model-len", "64", "--max-num-seqs", "2", "--log-level", "warning"],
                               env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = [process.stderr.readline()]
        while "serving" not in lines[-1]:
            assert lines[-1], "the server did not start:\n" + "".join(lines)
            lines.append(process.stderr.readline())
        host, port = re.search(r"http://([\d.]+):(\d+)", lines[-1]).groups()
        with socket.create_connection((host, int(port)), timeout=30) as first:  # at once: no retry, no sleep
            first.sendall(b"GET /health HTTP/1.1\r\nHost: torpor\r\nConnection: close\r\n\r\n")
            assert first.makefile("rb").readline().startswith(b"HTTP/1.1 200")
        for burner in burners:
            burner.kill()
        with httpx.Client(base_url=f"http://{host}:{port}", timeout=30) as http:
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny"]
            answer = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
            assert answer.status_code == 200, answer.text
        assert "stopped" in stop_server(process)
    finally:
        for child in [*burners, process]:
            if child.poll() is None:
                child.kill()
            child.wait()


@pytest.mark.slow  # a subprocess
def test_serve_tensor_parallel_answers_like_one_process_and_sleeps_on_every_rank(tiny_model_path):
    from torpor.engine import LLM, SamplingParams

    prompt, max_tokens = [5, 17, 300, 42, 7, 99, 1000, 3], 12
    reference = LLM(tiny_model_path, device="cpu", max_model_len=64, max_num_seqs=4, enable_sleep_mode=False)
    expected = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2,
                                                           ignore_eos=True))[0].outputs[0]
    del reference
    env = {**os.environ, "TORPOR_ADMIN_TOKEN": "tp-admin", "TORPOR_API_KEY": ""}
    argv = [tiny_model_path, "--device", "cpu", "--port", "0", "--max-model-len", "64", "--max-num-seqs", "4",
            "--served-model-name", "tiny", "--log-level", "warning", "--tensor-parallel-size", "2"]
    process, url, lines = start_server(argv, env)
    admin = {"Authorization": "Bearer tp-admin"}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2,
            "ignore_eos": True}
    try:
        assert any("tensor parallel over 2 ranks" in line for line in lines)
        assert any("engine ready" in line and "2 ranks from cpu" in line for line in lines)
        with httpx.Client(base_url=url, timeout=30) as http:
            first = http.post("/v1/completions", json=body).json()["choices"][0]
            assert first["text"] == expected.text  # the same tokens as one process
            logprobs = first["logprobs"]["token_logprobs"]
            assert len(logprobs) == max_tokens
            for served, (token, lp) in zip(logprobs, zip(expected.token_ids, expected.logprobs, strict=True),
                                           strict=True):
                assert abs(served - lp[token].logprob) < 1e-4  # fp32; the row-parallel sums add in another order
            ranks = http.get("/memory", headers=admin).json()["ranks"]
            assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["pid"] == process.pid
            worker_pid = ranks[1]["pid"]
            assert http.post("/sleep", params={"level": 1}, headers=admin).json()["is_sleeping"] is True
            asleep = http.get("/memory", headers=admin).json()["ranks"]
            for r in asleep:  # every rank released its weights and KV cache
                assert r["tags"]["weights"]["state"] == r["tags"]["kv_cache"]["state"] == "asleep", r
            woke = http.post("/wake_up", headers=admin).json()
            assert woke["is_sleeping"] is False and woke["serving"] is True
            again = http.post("/v1/completions", json=body).json()["choices"][0]
            assert again["text"] == first["text"] and again["logprobs"] == first["logprobs"]  # bit-identical
        assert "stopped" in stop_server(process)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{worker_pid}"):  # rank 1 left with rank 0 (reaped: not a zombie)
            assert time.monotonic() < deadline, "the worker outlived the server"
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
