"""Sleep levels 3 and 4 on CUDA: the engine's whole CUDA context released through the driver's checkpoint
API (0 MiB of device memory in the process by NVML), woken fully or selectively, bit-exact, CUDA graphs
kept; a restore refused while the device lacks the memory; the same over HTTP with a real `torpor serve`.

The checkpoint covers this whole pytest process, so run the module in a process of its own
(`scripts/gpu-check level3` does)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from torpor.engine import LLM  # noqa: E402
from torpor.memory import CheckpointError, checkpoint, cuda_driver  # noqa: E402
from torpor.testing.harness import differences, fixed_requests, run_round  # noqa: E402

MiB = 1 << 20


def _supported() -> str | None:
    try:
        checkpoint.check_support(cuda_driver.pci_bus_id(torch.cuda.current_device()))
    except Exception as exc:  # the reason level 3 cannot run here
        return str(exc)
    return None


@pytest.fixture(scope="module")
def model() -> str:
    from torpor.synthetic import cached_model_path

    return str(cached_model_path("qwen3-0.6b"))


@pytest.fixture(scope="module")
def llm(model):
    torch.zeros(1, device="cuda")
    reason = _supported()
    if reason is not None:
        pytest.skip(f"the CUDA checkpoint API is not usable here: {reason}")
    engine = LLM(model, device="cuda", max_num_seqs=16, max_model_len=512, gpu_memory_utilization=0.3)
    assert engine.engine.executor.driver.runner.graphs is not None  # CUDA graphs captured: they must survive
    return engine


@pytest.fixture(scope="module")
def requests(llm):
    return fixed_requests(16, llm.engine.vocab_size, max_prompt=64, max_tokens=16)


@pytest.fixture(scope="module")
def reference(llm, requests):
    return run_round(llm, requests)


@pytest.fixture(autouse=True)
def awake(llm):
    yield
    if llm.is_sleeping():
        llm.wake_up()
    if llm.engine.lifecycle.weights_discarded:
        llm.reload_weights()


def process_mib() -> float | None:
    """This process's device memory by NVML (read by the checkpoint helper); None if NVML does not list it."""
    readings = checkpoint.device_readings()
    if "process_bytes" not in readings:
        return None
    return readings["process_bytes"] / MiB


def test_level3_releases_everything_and_a_full_wake_is_bit_exact(llm, requests, reference):
    awake_mib = process_mib()
    report = llm.sleep(3)
    assert report is not None and llm.engine.lifecycle.context_released
    asleep = llm.memory_usage()  # answered without a CUDA call
    assert asleep["level"] == 3 and asleep["context_released"]
    assert asleep["tags"]["weights"]["state"] == "asleep"
    if awake_mib:  # NVML lists this PID: asleep it holds nothing
        assert process_mib() == 0.0, f"asleep at level 3 the process holds {process_mib()} MiB (awake {awake_mib})"
    result = llm.wake_up()
    assert result.serving and not llm.engine.lifecycle.context_released and not checkpoint.is_checkpointed()
    assert not differences(reference, run_round(llm, requests))


def test_level3_wake_weights_then_kv_cache(llm, requests, reference):
    llm.sleep(3)
    first = llm.wake_up(["weights"])  # the context comes back first, then the tags
    assert not first.serving and not llm.engine.lifecycle.context_released
    assert llm.wake_up(["kv_cache"]).serving
    assert not differences(reference, run_round(llm, requests))


def test_level3_then_reload_weights(llm, requests, reference):
    llm.sleep(3)
    llm.wake_up(["weights"])
    llm.reload_weights()
    llm.wake_up(["kv_cache"])
    assert not differences(reference, run_round(llm, requests))


def test_level4_discards_the_weights_too(llm, requests, reference):
    llm.sleep(4)
    usage = llm.memory_usage()
    assert usage["level"] == 4 and usage["weights_discarded"] and usage["tags"]["weights"]["host_backup_bytes"] == 0
    llm.wake_up(["weights"])
    llm.reload_weights()
    llm.wake_up(["kv_cache"])
    assert not differences(reference, run_round(llm, requests))


def test_deeper_while_checkpointed_restores_drops_and_releases_again(llm, requests, reference):
    llm.sleep(3)
    llm.sleep(2)  # 3 then 2 = 4: the weights' host copy goes, the context stays released
    usage = llm.memory_usage()
    assert usage["level"] == 4 and usage["context_released"] and usage["tags"]["weights"]["host_backup_bytes"] == 0
    assert llm.sleep(1) is None and llm.sleep(3) is None  # deepen nothing
    llm.wake_up()
    llm.reload_weights()
    assert not differences(reference, run_round(llm, requests))


def test_resleep_after_level3_keeps_the_weights_copy(llm, requests, reference):
    llm.sleep(3)
    llm.wake_up()
    again = llm.sleep(1)
    assert next(t.bytes_copied for t in again.tags if t.tag == "weights") == 0
    llm.wake_up()
    assert not differences(reference, run_round(llm, requests))


def test_restore_is_refused_while_the_device_lacks_the_memory(llm, requests, reference):
    llm.sleep(3)
    held = checkpoint.current().held_bytes
    if not held:
        pytest.skip("NVML gave no reading of what the checkpoint held")
    # Another process takes the device's free memory: the restore must refuse instead of getting stuck.
    hog = subprocess.Popen([sys.executable, "-c", (
        "import torch, sys\nblocks = []\n"
        "while True:\n    try:\n        blocks.append(torch.empty(64 << 20, dtype=torch.uint8, device='cuda'))\n"
        "    except torch.OutOfMemoryError:\n        break\n"
        "print('full', flush=True)\nsys.stdin.readline()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout.readline().strip() == "full"
        with pytest.raises(CheckpointError, match="stays checkpointed"):
            llm.wake_up()
        assert llm.engine.lifecycle.context_released and llm.is_sleeping()
    finally:
        hog.stdin.write("\n")
        hog.stdin.flush()
        hog.wait(60)
    llm.wake_up()
    assert not differences(reference, run_round(llm, requests))


def test_reading_a_sleeping_tensor_faults_on_cuda():
    """Documented behaviour (docs/memory.md): a sleeping tag's range is unmapped, so a kernel reading it gets an
    illegal-address fault, which is sticky (the context is lost) -- hence a child process."""
    code = ("import torch\nfrom torpor.memory import MemoryManager\nmm = MemoryManager('cuda')\n"
            "with mm.tag('w'):\n    t = torch.ones(1 << 20, device='cuda')\n"
            "mm.sleep({'w': 'offload'})\nprint(t.sum().item(), flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "cuda error" in out.stderr.lower(), (out.returncode, out.stderr[-2000:])


def test_level3_over_http(model):
    """A real `torpor serve`: level 3 over HTTP; /health, /is_sleeping, /metrics, /memory answer while the
    context is checkpointed; requests sent while asleep are answered after the wake, as before the sleep."""
    import asyncio

    import httpx

    token, port = "level3-admin", 8437
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "torpor", "serve", model, "--port", str(port), "--admin-token",
                               token, "--gpu-memory-utilization", "0.3", "--max-model-len", "512",
                               "--max-num-seqs", "16", "--log-level", "warning"],
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, "the server exited during start-up"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.5)
        # the server names the model after its folder
        body = dict(model=Path(model).name, prompt=[1, 2, 3, 4, 5], max_tokens=24, temperature=0, logprobs=2,
                    ignore_eos=True)

        def answer(r: httpx.Response) -> tuple:
            r.raise_for_status()
            choice = r.json()["choices"][0]
            return choice["text"], tuple(choice["logprobs"]["token_logprobs"])

        before = answer(admin.post("/v1/completions", json=body))
        slept = admin.post("/sleep", params={"level": 3})
        assert slept.status_code == 200, slept.text
        assert slept.json()["is_sleeping"]
        assert admin.get("/health").json()["is_sleeping"]
        assert admin.get("/is_sleeping").json() == {"is_sleeping": True}
        memory = admin.get("/memory").json()
        assert memory["level"] == 3 and memory["context_released"]
        assert admin.get("/metrics").status_code == 200
        readings = _nvml_process_mib(server.pid)
        if readings is not None:
            assert readings == 0, f"the asleep server process holds {readings} MiB"

        async def while_asleep() -> list[tuple]:
            async with httpx.AsyncClient(base_url=url, timeout=300) as client:
                tasks = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(4)]
                await asyncio.sleep(2)
                assert not any(t.done() for t in tasks)  # they wait for the wake
                woke = await client.post("/wake_up", headers={"Authorization": f"Bearer {token}"})
                assert woke.status_code == 200, woke.text
                return [answer(r) for r in await asyncio.gather(*tasks)]

        assert asyncio.run(while_asleep()) == [before] * 4
        assert answer(admin.post("/v1/completions", json=body)) == before
    finally:
        admin.close()
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def _nvml_process_mib(pid: int) -> float | None:
    """NVML's device memory of `pid` (0 when not listed), None when NVML cannot tell (module missing, or
    this PID namespace is not the one NVML reports)."""
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByPciBusId(cuda_driver.pci_bus_id(torch.cuda.current_device()).encode())
    mine = [p for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == os.getpid()]
    if not mine:
        return None  # this test process has a context: if NVML does not list it, the PIDs are not ours
    return sum(p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == pid) / MiB
