"""`ServerThread`: a torpor server (uvicorn) on a free port of 127.0.0.1 in a daemon thread, for the HTTP
tests on CPU and GPU; `wait_for` a condition; `error_of`: an OpenAI-shaped error response, checked."""

import threading
import time

import uvicorn

from torpor.cli.serve import bind_socket


class ServerThread:
    """uvicorn serving `app` on a free port of 127.0.0.1 from a daemon thread."""

    def __init__(self, app) -> None:
        sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        wait_for(lambda: self.server.started, what="the server to start")
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def wait_for(predicate, timeout: float = 20.0, what: str = "a condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def error_of(response, status: int) -> dict:
    """The `error` object of a response that must have `status` and OpenAI's error shape (all four fields)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]
