"""Sleep/wake and weight-push figures through torpor's public API only, so that two versions of torpor (one on
PYTHONPATH each) are measured by the same code, side by side in one run. Prints one JSON line.

    PYTHONPATH=old python3 scripts/bench_side_by_side.py MODEL --label old
    PYTHONPATH=.   python3 scripts/bench_side_by_side.py MODEL --label new

In process: `LLM()`'s seconds, the first level-1 sleep right after it returns (the host copies' background
reservation may not have finished), then, once it has, level-1 sleep / full wake, level-1 sleep / weights-only
wake / KV wake, level-2 sleep / wake + reload (medians of --rounds). Then a `torpor serve` process on the same
device and this process as the trainer: the push of the checkpoint's tensors (from the device) through
`WeightPusher` and the RL step over HTTP (sleep level 2, wake weights, push, wake kv_cache), medians of --rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def in_process(model: str, gmu: float, rounds: int) -> dict:
    from torpor import LLM
    from torpor.engine.phase_times import collect

    start = time.perf_counter()
    llm = LLM(model, gpu_memory_utilization=gmu)
    init_s = time.perf_counter() - start
    first = {"sleep": timed(lambda: llm.sleep(1)), "wake": timed(llm.wake_up)}
    deadline = time.monotonic() + 120
    while not (llm.memory_usage().get("host_reservation") or {"done": True})["done"] and time.monotonic() < deadline:
        time.sleep(0.1)
    rows: dict[str, list[float]] = {k: [] for k in ("l1_sleep", "l1_wake", "l1_sleep_again", "weights_wake",
                                                    "kv_wake", "l2_sleep", "l2_wake", "reload")}
    reload_phases: list[dict] = []
    for _ in range(rounds):
        llm.reload_weights()  # a write: the next level-1 sleep copies the weights again
        rows["l1_sleep"].append(timed(lambda: llm.sleep(1)))
        rows["l1_wake"].append(timed(llm.wake_up))
        rows["l1_sleep_again"].append(timed(lambda: llm.sleep(1)))  # unchanged weights: the copy is kept
        rows["weights_wake"].append(timed(lambda: llm.wake_up(["weights"])))
        rows["kv_wake"].append(timed(lambda: llm.wake_up(["kv_cache"])))
        rows["l2_sleep"].append(timed(lambda: llm.sleep(2)))
        rows["l2_wake"].append(timed(llm.wake_up))
        with collect() as record:
            rows["reload"].append(timed(llm.reload_weights))
        reload_phases.append(record)
    usage = llm.memory_usage()
    weights = usage["tags"]["weights"]
    kv = usage["tags"]["kv_cache"]
    result = {"llm_init_s": init_s, "startup_phases_s": dict(getattr(llm, "startup_phases", None) or {}),
              "first_l1_sleep_s": first["sleep"], "first_l1_wake_s": first["wake"],
              "weights_bytes": weights.get("reserved_bytes") or weights.get("allocated_bytes"),
              "kv_bytes": kv.get("reserved_bytes") or kv.get("allocated_bytes"),
              **{f"{k}_s": statistics.median(v) for k, v in rows.items()},
              "reload_phases_s": {k: statistics.median(r.get(k, 0.0) for r in reload_phases)
                                  for k in sorted({k for r in reload_phases for k in r})}}
    llm.close()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def pushes(model: str, gmu: float, rounds: int) -> dict:
    from safetensors.torch import load_file

    from torpor.rl import WeightPusher
    from torpor.rl.engine_process import EngineProcess

    files = sorted(__import__("pathlib").Path(model).glob("*.safetensors"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    named = [item for f in files for item in load_file(str(f), device=device).items()]
    with EngineProcess(model, ["--gpu-memory-utilization", str(gmu)]) as engine:
        pusher = WeightPusher(engine.url, engine.admin_token)
        pusher.push(named)  # warm-up
        push_s = [pusher.push(named).seconds for _ in range(rounds)]
        step = []
        for _ in range(rounds):
            start = time.perf_counter()
            engine.post("/sleep", params={"level": 2})
            engine.post("/wake_up", params={"tags": "weights"})
            pusher.push(named)
            engine.post("/wake_up", params={"tags": "kv_cache"})
            step.append(time.perf_counter() - start)
    nbytes = sum(t.nbytes for _, t in named)
    return {"push_s": statistics.median(push_s), "push_gbps": nbytes / 1e9 / statistics.median(push_s),
            "push_all_s": push_s, "rl_step_s": statistics.median(step), "rl_step_all_s": step,
            "push_bytes": nbytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--label", default="this")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--push-rounds", type=int, default=None, help="rounds of the push and of the RL step "
                        "(default: --rounds); they are cheap, and the push's figure is the noisier one")
    parser.add_argument("--no-push", action="store_true")
    args = parser.parse_args()
    import torpor

    result = {"label": args.label, "torpor": torpor.__file__, "gmu": args.gpu_memory_utilization,
              **in_process(args.model, args.gpu_memory_utilization, args.rounds)}
    if not args.no_push:
        try:
            result.update(pushes(args.model, args.gpu_memory_utilization, args.push_rounds or args.rounds))
        except Exception as exc:  # the in-process figures still print
            result["push_error"] = f"{type(exc).__name__}: {exc}"[-2000:]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
