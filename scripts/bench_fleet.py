"""A RolloutFleet's control-plane latency by fleet size, on CPU: no GPU, no model work worth the name.

For fleets of 1, 2, 4 and 8 replicas of the tiny model (each a Ray actor with one CPU) it times, `--repeats`
times each, the fleet-wide calls an RL step makes: a liveness ping of every replica (Ray's round trip, the floor),
`collective_rpc("is_sleeping")` (a control call through the engine, no memory work), `sleep(1)` and `wake_up()`
(the tiny model's ~1 MiB of weights and runtime state: what remains is the fan-out), and a weight-version bump
(`reload_weights` of the same checkpoint, ~1 MiB read). It prints the median and p90 per call and fleet size,
and the growth per added replica (a least-squares slope), the figures docs/scaling.md extrapolates from.

    python scripts/bench_fleet.py                       # 1, 2, 4, 8 replicas, 20 repeats
    python scripts/bench_fleet.py --replicas 1,2,4 --repeats 10 --json fleet.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import ray

from torpor.ray import RolloutFleet

ENGINE = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 128, "enforce_eager": True,
          "reserve_host_copies": False}


def timed(call, repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return seconds


def measure(replicas: int, repeats: int) -> dict[str, list[float]]:
    start = time.perf_counter()
    fleet = RolloutFleet(None, num_replicas=replicas, device="cpu", engine_kwargs=ENGINE, num_cpus_per_replica=1)
    started = time.perf_counter() - start
    try:
        handles = fleet.replicas
        fleet.sleep(1)
        fleet.wake_up()  # the first cycle reserves the host copies: not timed
        results = {"start-up (once)": [started],
                   "ping": timed(lambda: ray.get([h.ping.remote() for h in handles]), repeats),
                   "collective_rpc": timed(lambda: fleet.collective_rpc("is_sleeping"), repeats),
                   "sleep(1)": [], "wake_up()": [],
                   "weight version": timed(lambda: fleet.reload_weights(), repeats)}
        for _ in range(repeats):
            results["sleep(1)"] += timed(lambda: fleet.sleep(1), 1)
            results["wake_up()"] += timed(fleet.wake_up, 1)
        return results
    finally:
        fleet.shutdown()


def slope(xs: list[int], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", default="1,2,4,8", help="fleet sizes, comma-separated")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None, help="also write the raw timings here")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.replicas.split(",")]
    ray.init(address="local", num_cpus=max(sizes) + 1, include_dashboard=False, log_to_driver=False)
    try:
        raw = {n: measure(n, args.repeats) for n in sizes}
    finally:
        ray.shutdown()
    calls = list(next(iter(raw.values())))
    print(f"{'call':<18}" + "".join(f"{f'{n} replica(s)':>22}" for n in sizes) + f"{'per added replica':>20}")
    for call in calls:
        medians = [statistics.median(raw[n][call]) for n in sizes]
        cells = []
        for n in sizes:
            values = sorted(raw[n][call])
            p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
            cells.append(f"{statistics.median(values) * 1e3:9.2f} / {p90 * 1e3:7.2f} ms")
        print(f"{call:<18}" + "".join(f"{c:>22}" for c in cells) + f"{slope(sizes, medians) * 1e3:15.2f} ms")
    print("(median / p90 over the repeats; start-up is one measurement)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(n): v for n, v in raw.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
