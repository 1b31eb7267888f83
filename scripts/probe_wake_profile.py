"""Probe (CUDA): where a level-1 wake of the weights spends its time, beside a small and a large KV cache, and
how soon after `LLM()` returns the host copies' background reservation is done (the first sleep waits for it).

For each `--gmu` a child process starts an engine, records when `LLM()` returned and when the reservation ended,
then per round: reload (the weights dirty), level-1 sleep, wake of the weights (immediately, or after `--delays`
seconds), wake of the KV cache. Every driver call of the wake is timed (cuMemCreate, cuMemMap, cuMemSetAccess, the
copies' enqueue, the final synchronization), and the engine's wake against the memory manager's. One JSON line per
gmu, then a summary table.

    python3 scripts/probe_wake_profile.py MODEL --gmu 0.15,0.9 --delays 0,1,3
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import torch


class _Timed:
    """A stand-in for the driver module that adds the seconds of the named calls to `totals`."""

    def __init__(self, cu, names: tuple[str, ...], totals: dict[str, float]) -> None:
        self._cu, self._names, self._totals = cu, names, totals

    def __getattr__(self, name: str):
        fn = getattr(self._cu, name)
        if name not in self._names:
            return fn

        def timed(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self._totals[name] += time.perf_counter() - start
                self._totals[name + "_n"] += 1
        return timed


def child(model: str, gmu: float, delays: list[float], rounds: int) -> dict:
    from torpor import LLM
    from torpor.memory import cuda_driver

    loader_lines: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            loader_lines.append(record.getMessage())

    log = logging.getLogger("torpor.engine.weights.loader")
    log.setLevel(logging.DEBUG)
    log.addHandler(Grab())

    t0 = time.perf_counter()
    llm = LLM(model, gpu_memory_utilization=gmu)
    returned = time.perf_counter() - t0
    reservation = llm.engine.host_reservation
    while reservation is not None and not reservation.done:
        time.sleep(0.01)
    reserved_after = time.perf_counter() - t0 - returned
    memory = llm.engine.memory
    backend = memory._backend
    segs = defaultdict(list)
    for seg in backend.segments.values():
        segs[seg.tag].append(seg.size)
    totals: dict[str, float] = defaultdict(float)
    backend.vm.cu = _Timed(backend.vm.cu, ("cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap",
                                           "cuMemRelease"), totals)
    copy_h2d, memset = cuda_driver.copy_h2d, cuda_driver.memset_zero

    def timed_copy(*args):
        start = time.perf_counter()
        copy_h2d(*args)
        totals["h2d_enqueue"] += time.perf_counter() - start

    def timed_memset(*args):
        start = time.perf_counter()
        memset(*args)
        totals["memset_enqueue"] += time.perf_counter() - start

    cuda_driver.copy_h2d, cuda_driver.memset_zero = timed_copy, timed_memset
    sync = backend._finish_fills

    def timed_sync():
        start = time.perf_counter()
        sync()
        totals["final_sync"] += time.perf_counter() - start

    backend._finish_fills = timed_sync
    mem_wake = memory.wake

    def timed_mem_wake(*a, **k):
        start = time.perf_counter()
        try:
            return mem_wake(*a, **k)
        finally:
            totals["memory_wake"] += time.perf_counter() - start

    memory.wake = timed_mem_wake
    from torpor.engine.phase_times import collect

    rows = []
    reloads = []
    reload_phases = []
    for delay in delays:
        for _ in range(rounds):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with collect() as record:
                llm.reload_weights()
                torch.cuda.synchronize()
            reloads.append(time.perf_counter() - start)
            reload_phases.append(_round(record))
            start = time.perf_counter()
            llm.sleep(1)
            slept = time.perf_counter() - start
            sleep_totals = dict(totals)
            totals.clear()
            time.sleep(delay)
            start = time.perf_counter()
            llm.wake_up(["weights"])
            torch.cuda.synchronize()
            weights = time.perf_counter() - start
            wake_totals = dict(totals)
            totals.clear()
            start = time.perf_counter()
            llm.wake_up(["kv_cache"])
            torch.cuda.synchronize()
            kv = time.perf_counter() - start
            kv_totals = dict(totals)
            totals.clear()
            rows.append({"delay_s": delay, "sleep_s": slept, "weights_wake_s": weights, "kv_wake_s": kv,
                         "sleep_calls": _round(sleep_totals), "weights_calls": _round(wake_totals),
                         "kv_calls": _round(kv_totals)})
    l2 = []
    for _ in range(rounds):  # as bench_side_by_side times it: a reload right after a level-2 wake
        llm.sleep(2)
        llm.wake_up()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with collect() as record:
            llm.reload_weights()
            torch.cuda.synchronize()
        l2.append({"s": round(time.perf_counter() - start, 4), **_round(record)})
    llm.close()
    return {"gmu": gmu, "startup_phases": _round(llm.startup_phases), "reload_phases": reload_phases,
            "reload_after_l2": l2, "llm_returned_s": returned,
            "reservation_done_after_return_s": reserved_after,
            "reservation_seconds": None if reservation is None else reservation.seconds,
            "reserved_gib": None if reservation is None else reservation.reserved_bytes / 2**30,
            "segments": {tag: {"count": len(v), "gib": sum(v) / 2**30, "largest_mib": max(v) / 2**20}
                         for tag, v in segs.items()},
            "reload_s": statistics.median(reloads), "loader_lines": loader_lines[-2:], "rounds": rows}


def _round(d: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in d.items()}


def pin_speeds(gib: int, threads: list[int]) -> list[dict]:
    """Touch + register `gib` GiB in 1 GiB buffers with each thread count (the reservation's two steps)."""
    from torpor.memory import cuda_driver, host_buffer

    torch.cuda.init()
    torch.cuda.synchronize()
    out = []
    for n in threads:
        host_buffer._TOUCH_THREADS = n
        host_buffer._touch_pool.cache_clear()
        touch = register = 0.0
        buffers = []
        for _ in range(gib):
            size = 1 << 30
            m, base = host_buffer._anonymous_map(size + host_buffer._HUGE_PAGE)
            ptr = -(-base // host_buffer._HUGE_PAGE) * host_buffer._HUGE_PAGE
            m.madvise(host_buffer.mmap.MADV_HUGEPAGE)
            start = time.perf_counter()
            host_buffer._touch(ptr, size)
            mid = time.perf_counter()
            cuda_driver.host_register(ptr, size)
            register += time.perf_counter() - mid
            touch += mid - start
            buffers.append((m, ptr))
        for m, ptr in buffers:
            cuda_driver.host_unregister(ptr)
            m.close()
        out.append({"threads": n, "gib": gib, "touch_s": touch, "register_s": register,
                    "gib_per_s": gib / (touch + register)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--gmu", default="0.15,0.9")
    parser.add_argument("--delays", default="0,1,3")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pin-gib", type=int, default=16)
    parser.add_argument("--pin-threads", default="2,4,8,16")
    parser.add_argument("--child", type=float, default=None)
    args = parser.parse_args()
    delays = [float(d) for d in args.delays.split(",")]
    if args.child is not None:
        print(json.dumps(child(args.model, args.child, delays, args.rounds)), flush=True)
        return
    if args.pin_gib:
        code = (f"import json, sys; sys.path.insert(0, 'scripts'); import probe_wake_profile as p; "
                f"print(json.dumps(p.pin_speeds({args.pin_gib}, {[int(t) for t in args.pin_threads.split(',')]})))")
        pin = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        print(pin.stdout.strip() or pin.stderr[-2000:], flush=True)
    for gmu in (float(g) for g in args.gmu.split(",")):
        proc = subprocess.run([sys.executable, __file__, args.model, "--child", str(gmu), "--delays", args.delays,
                               "--rounds", str(args.rounds)], capture_output=True, text=True, timeout=400)
        line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        if not line.startswith("{"):
            print(f"gmu {gmu}: failed\n{proc.stderr[-3000:]}", flush=True)
            continue
        print(line, flush=True)
        result = json.loads(line)
        print(f"gmu {gmu}: LLM() {result['llm_returned_s']:.2f} s, reservation done "
              f"{result['reservation_done_after_return_s']:.2f} s later ({result['reservation_seconds']:.2f} s, "
              f"{result['reserved_gib']:.2f} GiB); reload {result['reload_s']:.3f} s", flush=True)
        for row in result["rounds"]:
            w = row["weights_calls"]
            calls = " ".join(f"{k} {w.get(k, 0):.3f}" for k in ("memory_wake", "cuMemCreate", "cuMemMap",
                                                                 "cuMemSetAccess", "h2d_enqueue", "final_sync"))
            print(f"  delay {row['delay_s']:.0f} s: sleep {row['sleep_s']:.3f}  weights wake "
                  f"{row['weights_wake_s']:.3f} ({calls})  kv wake {row['kv_wake_s']:.3f}", flush=True)


if __name__ == "__main__":
    main()
