"""Level 3's mechanism without a GPU: the checkpoint helper process (start, commands, timeout, crash), its
restore precondition, and the preconditions a context checkpoint checks before touching anything."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import signal
import threading

import pytest

from torpor.memory import (
    CheckpointError,
    CheckpointUnsupportedError,
    MemoryManager,
    checkpoint,
)
from torpor.memory import checkpoint_helper as helper_module

HAS_BINDINGS = importlib.util.find_spec("cuda") is not None and importlib.util.find_spec("cuda.bindings") is not None


@pytest.fixture
def helper():
    h = checkpoint.CheckpointHelper()
    yield h
    h.stop()


def test_helper_starts_once_and_answers(helper):
    first = helper.request("hello", 30)
    assert first["pid"] == helper.pid != os.getpid()
    again = helper.request("hello", 30)
    assert again["pid"] == first["pid"]  # persistent: one process for every request
    assert "driver_version" in first and "problem" in first


def test_helper_reports_an_unknown_operation(helper):
    with pytest.raises(CheckpointError, match="unknown operation 'fly'"):
        helper.request("fly", 30)
    assert helper.request("hello", 30)["ok"]  # still serving


def test_helper_that_does_not_answer_is_stopped_and_replaced(helper):
    pid = helper.request("hello", 30)["pid"]
    os.kill(pid, signal.SIGSTOP)  # a helper stuck in a driver call
    with pytest.raises(CheckpointError, match="did not answer 'hello' within 1 s"):
        helper.request("hello", 1)
    assert helper.process is None
    assert helper.request("hello", 30)["pid"] != pid


def test_helper_crash_is_a_clear_error_and_the_next_call_restarts_it(helper):
    pid = helper.request("hello", 30)["pid"]
    os.kill(pid, signal.SIGSTOP)  # it dies while the request waits for its answer
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    with pytest.raises(CheckpointError, match=r"exited with code -9 during 'hello'"):
        helper.request("hello", 30)
    assert helper.request("hello", 30)["pid"] != pid


def test_a_helper_that_died_between_requests_is_replaced(helper):
    pid = helper.request("hello", 30)["pid"]
    os.kill(pid, signal.SIGKILL)
    helper.process.wait(10)
    assert helper.request("hello", 30)["pid"] != pid


def test_helper_protocol_one_reply_per_line():
    requests = io.StringIO('{"op": "hello"}\n\nnot json\n{"op": "memory", "pid": 1}\n')
    replies = io.StringIO()
    helper_module.serve(requests, replies)
    lines = [json.loads(line) for line in replies.getvalue().splitlines()]
    assert [r["ok"] for r in lines] == [True, False, True]
    assert lines[2] == {"ok": True}  # no bus id: readings unknown, not an error


def test_restore_refuses_when_the_device_lacks_the_memory_it_held():
    class Readings(helper_module.Nvml):
        def __init__(self) -> None:
            self.nvml = None

        def readings(self, pid, pci_bus_id):
            return {"total_bytes": 8 << 30, "free_bytes": 1 << 30, "used_bytes": 7 << 30, "process_bytes": 0}

    with pytest.raises(MemoryError, match="needs 2048 MiB of device memory and 1024 MiB are free"):
        helper_module._restore(helper_module.Driver.__new__(helper_module.Driver), Readings(), 1, "0000:00:00.0",
                               2 << 30)


@pytest.mark.skipif(HAS_BINDINGS, reason="cuda-bindings is installed here")
def test_check_support_names_the_missing_bindings():
    with pytest.raises(CheckpointUnsupportedError, match="cuda-bindings is not installed"):
        checkpoint.check_support()
    assert not checkpoint.is_checkpointed()


def test_cpu_manager_cannot_checkpoint_and_nothing_changes(tmp_path):
    import torch

    mm = MemoryManager("cpu", backup_dir=str(tmp_path))
    with mm.tag("weights"):
        w = torch.ones(10)
    with pytest.raises(CheckpointUnsupportedError, match="has none"):
        mm.checkpoint_context()
    assert isinstance(CheckpointUnsupportedError("x"), ValueError)  # a precondition: the server answers 4xx
    assert not mm.is_context_checkpointed() and mm.restore_context() is None
    assert not mm.is_sleeping() and w.sum() == 10
