"""`EngineProcess`: a `torpor serve` subprocess for a trainer to drive over HTTP (admin token set)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port of 127.0.0.1 free right now (for a server, or the store of a weights update group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineProcess:
    """Starts `torpor serve MODEL --admin-token TOKEN` on a free port of 127.0.0.1 with `serve_args` (e.g.
    ["--device", "cuda:0"]), waits until it answers /health; `post` raises on any non-200 answer."""

    def __init__(self, model: str, serve_args: list[str], admin_token: str = "torpor-admin",
                 env: dict[str, str] | None = None, start_timeout: float = 900) -> None:
        port = free_port()
        command = [sys.executable, "-m", "torpor", "serve", model, "--port", str(port), "--admin-token", admin_token,
                   "--log-level", "warning", *serve_args]
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        # The log goes to a file, not a pipe: nobody drains it while the trainer works.
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in close())
        self.process = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": path, **(env or {})},
                                        stdout=self.log, stderr=subprocess.STDOUT)
        self.admin_token = admin_token
        self.url = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.url, timeout=900, headers={"Authorization": f"Bearer {admin_token}"})
        try:
            self._wait_ready(start_timeout)
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"torpor serve exited ({self.process.returncode}):\n{self.output()}")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"torpor serve did not start within {timeout} s:\n{self.output()}")

    def output(self) -> str:
        """The last 4000 characters the server printed."""
        self.log.seek(0)
        return self.log.read()[-4000:]

    def post(self, path: str, **kw) -> dict:
        response = self.http.post(path, **kw)
        if response.status_code != 200:
            raise RuntimeError(f"POST {path}: {response.status_code} {response.text}")
        return response.json()

    def timed(self, path: str, **kw) -> float:
        """Seconds one successful POST took, as the client sees it."""
        start = time.perf_counter()
        self.post(path, **kw)
        return time.perf_counter() - start

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.http.close()
        self.log.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
