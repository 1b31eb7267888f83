"""`torpor serve`: its help, its exit codes, and a whole run in a subprocess (start-up progress, serving,
the control plane from the environment's admin token, a clean stop on SIGTERM)."""

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
    for option in ("--host", "--port", "--device", "--dtype", "--max-model-len", "--max-num-seqs", "--admin-token",
                   "--api-key", "--max-body-bytes", "--max-tokens-cap", "--asleep-timeout", "TORPOR_ADMIN_TOKEN",
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


def test_serve_runs_and_stops_cleanly_on_sigterm(tiny_model_path):
    env = {**os.environ, "TORPOR_ADMIN_TOKEN": "from-env", "TORPOR_API_KEY": ""}
    argv = [sys.executable, "-m", "torpor", "serve", tiny_model_path, "--device", "cpu", "--port", "0",
            "--max-model-len", "64", "--max-num-seqs", "4", "--served-model-name", "tiny", "--log-level", "warning"]
    process = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while not any("serving" in line for line in lines):
            line = process.stderr.readline()
            assert line and time.monotonic() < deadline, "".join(lines)
            lines.append(line)
        assert any("loading" in line for line in lines) and any("engine ready" in line for line in lines)
        url = re.search(r"http://[\d.]+:\d+", lines[-1]).group(0)
        assert "control plane: on" in lines[-1]
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.get("/health").json()["status"] == "ok"
            answer = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3})
            assert answer.json()["usage"]["completion_tokens"] >= 1
            slept = http.post("/sleep", params={"level": 1}, headers={"Authorization": "Bearer from-env"})
            assert slept.json()["is_sleeping"] is True
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert "stopped" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
