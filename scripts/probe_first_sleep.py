"""Probe (CUDA): what the first level-1 sleep right after `LLM()` pays for, and what pinning its host copies
beside the start-up would cost the start-up. One child process per mode, each printing one JSON line:

- `off`: `LLM(reserve_host_copies=False)`, then a level-1 sleep at once: the sleep pins every host copy itself
  (each buffer made while the copy into the one before runs).
- `default`: `LLM()` (the reservation on a background thread after start-up), then a level-1 sleep at once.
- `touch:K`: K threads fault in (zero) as many huge-page-backed host bytes as the checkpoint holds, started just
  before `LLM(reserve_host_copies=False)`: how much longer `LLM()` takes, and when the touch ends. Then that memory
  is registered with the driver in 64 MiB pieces by 1, 4 and 8 threads (does registering scale with threads?).
- `register-beside`: the memory touched before `LLM()`, then registered in 64 MiB pieces on one thread beside
  `LLM(reserve_host_copies=False)`: how much longer `LLM()` takes while the driver pins.

    python3 scripts/probe_first_sleep.py MODEL --modes off,default,touch:2,touch:4,register-beside
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

PIECE = 64 << 20


def _checkpoint_bytes(model: str) -> int:
    return sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model) if f.endswith(".safetensors"))


def _region(size: int):
    from torpor.memory import host_buffer

    m, base = host_buffer._anonymous_map(size + host_buffer._HUGE_PAGE)
    ptr = -(-base // host_buffer._HUGE_PAGE) * host_buffer._HUGE_PAGE
    m.madvise(host_buffer.mmap.MADV_HUGEPAGE)
    return m, ptr


def _touch(ptr: int, size: int, threads: int) -> None:
    import ctypes

    step = -(-size // (threads * PIECE)) * PIECE
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda s: ctypes.memset(ptr + s, 0, min(step, size - s)), range(0, size, step)))


def _register(ptr: int, size: int, threads: int) -> float:
    from torpor.memory import cuda_driver

    device = torch.cuda.current_device()

    def one(start: int) -> None:
        cuda_driver.make_primary_context_current(device)
        cuda_driver.host_register(ptr + start, min(PIECE, size - start))

    begin = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(0, size, PIECE)))
    return time.perf_counter() - begin


def _unregister(ptr: int, size: int) -> None:
    from torpor.memory import cuda_driver

    for start in range(0, size, PIECE):
        cuda_driver.host_unregister(ptr + start)


def _sleep_s(llm) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.sleep(1)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _beside_llm(model: str, gmu: float, work):
    """`work()` on a thread started just before `LLM(reserve_host_copies=False)`: (the LLM, seconds `LLM()` took,
    seconds until `work` ended), both from the same start."""
    from torpor import LLM

    done: dict[str, float] = {}
    start = time.perf_counter()
    worker = threading.Thread(target=lambda: (work(), done.setdefault("t", time.perf_counter() - start)))
    worker.start()
    llm = LLM(model, gpu_memory_utilization=gmu, reserve_host_copies=False)
    init_s = time.perf_counter() - start
    worker.join()
    return llm, init_s, done["t"]


def child(model: str, mode: str, gmu: float) -> dict:
    from torpor import LLM

    torch.zeros(1, device="cuda")  # the context exists in every mode before anything is timed
    size = -(-_checkpoint_bytes(model) // PIECE) * PIECE
    out: dict = {"mode": mode, "host_bytes": size}
    if mode in ("off", "default"):
        start = time.perf_counter()
        llm = LLM(model, gpu_memory_utilization=gmu, reserve_host_copies=(mode == "default"))
        out["llm_init_s"] = time.perf_counter() - start
        out["first_sleep_s"] = _sleep_s(llm)
        llm.wake_up()
        llm.reload_weights()
        out["later_sleep_s"] = _sleep_s(llm)
        llm.close()
        return out
    m, ptr = _region(size)
    if mode.startswith("touch:"):
        threads = int(mode.split(":")[1])
        llm, out["llm_init_s"], out["touch_done_s"] = _beside_llm(model, gmu, lambda: _touch(ptr, size, threads))
        for n in (1, 4, 8):
            out[f"register_{n}_threads_s"] = _register(ptr, size, n)
            _unregister(ptr, size)
    elif mode == "register-beside":
        t0 = time.perf_counter()
        _touch(ptr, size, 16)
        out["touch_16_threads_s"] = time.perf_counter() - t0
        llm, out["llm_init_s"], out["register_done_s"] = _beside_llm(model, gmu, lambda: _register(ptr, size, 1))
        _unregister(ptr, size)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    llm.close()
    m.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--modes", default="off,default,touch:2,touch:4,register-beside")
    parser.add_argument("--gmu", type=float, default=0.85)
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.model, args.child, args.gmu)), flush=True)
        return
    for mode in args.modes.split(","):
        proc = subprocess.run([sys.executable, __file__, args.model, "--child", mode, "--gmu", str(args.gmu)],
                              capture_output=True, text=True, timeout=300)
        lines = proc.stdout.strip().splitlines()
        if not lines or not lines[-1].startswith("{"):
            print(f"{mode}: failed\n{proc.stderr[-2000:]}", flush=True)
            continue
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in json.loads(lines[-1]).items()}),
              flush=True)


if __name__ == "__main__":
    main()
