"""`torpor bench sleep`: the engine's sleep mode measured in one run (default model: the synthetic qwen3-8b on
a GPU, the tiny model on CPU; CUDA graphs on a GPU).

Default run: device memory awake and asleep against the bare CUDA context; sleep and wake seconds and GB/s
against the pinned host link measured in the same run, for the first level-1 sleep after start-up, a re-sleep
with the weights unchanged (their host copy kept), a level-1 sleep after a weight write and a level-2 sleep
(+ `reload_weights`); the reload (page cache warm and cold) and a level-2 wake + reload; a cold start in a new
process, by phase; then the bit-exact harness (`--requests`) and a soak of `--soak-cycles` cycles.

Modes: `--loader-only` the weight rows and cold starts by phase (profiling the KV-sizing step, reading it
back, the page cache dropped), the answers checked unchanged; `--cold-start-only` the cold starts alone;
`--soak-only` the harness and the soak; `--kv-curve` the level-1 sleep and wakes with the KV cache sized by
`gpu_memory_utilization` 0.15, 0.5, 0.85 and 0.9; `--level3` levels 3 and 4 (below).
The exit code is 0 when every compared round was bit-identical.
"""

from __future__ import annotations

import argparse
import time

import torch

from torpor.cli.bench_common import (
    BESIDE_PHASES,
    MiB,
    Run,
    add_json_option,
    check_json_path,
    checkpoint_files,
    cold_start,
    console,
    drop_page_cache,
    fmt_bytes,
    fmt_pct,
    fmt_rate,
    fmt_s,
    median,
    median_run,
    pinned_bandwidth,
    progress,
    release,
    resolve_device,
    resolve_model,
    sync,
    table,
    tensor_bytes,
    vocab_size,
    warm_page_cache,
    write_json,
)
from torpor.memory import device_used_bytes

KV_CURVE = (0.15, 0.5, 0.85, 0.9)  # gpu_memory_utilization of each engine of --kv-curve
MODES = ("loader_only", "cold_start_only", "soak_only", "kv_curve", "level3")
# The engine's defaults (256 sequences of up to 4096 tokens) leave the KV cache room to grow with the budget;
# the other modes' 64 x 2048 cap it near 19 GiB for qwen3-8b.
SIZES = {"kv_curve": (256, 4096)}
DEFAULT_SIZES = (64, 2048)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sleep", help="sleep-mode memory, speed, bit-exactness and soak of the engine",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder or preset name (default: qwen3-8b on a GPU, "
                   "the tiny model on CPU); presets are generated into the cache on first use")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda or cuda:N")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default 64 (--kv-curve: 256)")
    p.add_argument("--max-model-len", type=int, default=None, help="default 2048 (--kv-curve: 4096)")
    p.add_argument("--requests", type=int, default=64, help="requests in the bit-exact batch")
    p.add_argument("--soak-cycles", type=int, default=20)
    p.add_argument("--cold-starts", type=int, default=3, help="--loader-only, --cold-start-only: starts of the "
                   "default whose median is shown")
    modes = p.add_mutually_exclusive_group()
    modes.add_argument("--loader-only", action="store_true", help="only the weight rows: reload (page cache "
                       "warm and cold), level-2 wake + reload, cold starts by phase")
    modes.add_argument("--cold-start-only", action="store_true", help="only the cold starts in new processes")
    modes.add_argument("--soak-only", action="store_true", help="only the bit-exact harness and the soak")
    modes.add_argument("--kv-curve", action="store_true", help="only the level-1 sleep and wakes at "
                       f"gpu_memory_utilization {', '.join(map(str, KV_CURVE))} (one engine each)")
    modes.add_argument("--level3", action="store_true", help="levels 3 and 4, the first sleep with the host copies "
                       "reserved, the re-sleep, start-up with and without the reservation (CUDA only)")
    add_json_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    device = args.device = resolve_device(args.device)
    if args.level3 and not device.startswith("cuda"):
        raise ValueError("--level3 needs a CUDA device (level 3 releases the CUDA context)")
    for name in ("requests", "soak_cycles", "cold_starts"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    check_json_path(args.json)
    mode = next((m for m in MODES if getattr(args, m)), "default")
    seqs, length = SIZES.get(mode, DEFAULT_SIZES)
    args.max_num_seqs = args.max_num_seqs or seqs
    args.max_model_len = args.max_model_len or length
    model, label = resolve_model(args.model, device)
    run_ = Run(device, label)
    results: dict = {"run": run_.describe(), "mode": mode, "max_num_seqs": args.max_num_seqs,
                     "max_model_len": args.max_model_len}
    if device.startswith("cuda"):
        torch.zeros(1, device=device)  # the bare context: what every asleep figure is compared with
    results["bare_context_bytes"] = device_used_bytes(device)
    results["link_gbps"] = pinned_bandwidth(device) if device.startswith("cuda") else {}
    bench = {"default": run_default, "loader_only": run_loader, "cold_start_only": run_cold_starts,
             "soak_only": run_soak, "kv_curve": run_kv_curve, "level3": run_level3}[mode]
    exact = bench(model, args, run_, results)
    write_json(args.json, results)
    return 0 if exact else 1


def build(model: str, args: argparse.Namespace, **options):
    """An `LLM` of the bench's sizes, and the seconds its construction took in this process."""
    from torpor import LLM  # (the benches import the engine when they run, not when `torpor` builds its parser)

    start = time.perf_counter()
    llm = LLM(model, device=args.device, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              **options)
    return llm, time.perf_counter() - start


def engine_options(args: argparse.Namespace) -> dict:
    return {"max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len}


def wait_for_reservation(llm, timeout: float = 600.0) -> dict:
    """Until the engine's background host-copy reservation ended: its bytes and the seconds waited."""
    start = time.perf_counter()
    while True:
        reservation = llm.memory_usage()["host_reservation"]
        if reservation is None or reservation["done"] or time.perf_counter() - start > timeout:
            break
        time.sleep(0.05)
    return {"reserved_bytes": reservation["reserved_bytes"] if reservation else 0,
            "done": reservation is None or reservation["done"], "waited_s": time.perf_counter() - start}


# ---- the default run --------------------------------------------------------------------------------------
def sleep_row(llm, level: int, name: str) -> dict:
    """One sleep at `level` and a full wake (+ `reload_weights` after level 2); memory awake and asleep, the
    asleep memory's audit. `sleep_s` is the memory layer's own time of the sleep (its Report); `wake_s` the
    wall time of `wake_up`, `reload_s` of the reload after it."""
    awake = llm.memory_usage()
    report = llm.sleep(level)
    asleep = llm.memory_usage()
    audit = llm.memory.audit()  # what stays while asleep: the default pool, and outside any allocator
    start = time.perf_counter()
    woke = llm.wake_up()
    wake_s = time.perf_counter() - start
    reload_s = None
    if level == 2:
        start = time.perf_counter()
        llm.reload_weights()
        sync(llm.config.device)
        reload_s = time.perf_counter() - start
    return {"name": name, "level": level, "awake_bytes": awake["device_used_bytes"],
            "asleep_bytes": asleep["device_used_bytes"], "sleep_s": report.seconds,
            "sleep_copied_bytes": report.bytes_copied, "sleep_released_bytes": report.bytes_released,
            "wake_s": wake_s, "wake_copied_bytes": woke.report.bytes_copied, "reload_s": reload_s,
            "asleep_tagged_bytes": audit.tagged_bytes, "asleep_default_pool_bytes": audit.untagged_bytes,
            "asleep_other_bytes": audit.other_bytes,
            "tags_awake": {tag: {"resident_bytes": u["resident_bytes"], "allocated_bytes": u["allocated_bytes"]}
                           for tag, u in awake["tags"].items()}}


def run_default(model: str, args: argparse.Namespace, run_: Run, results: dict) -> bool:
    progress(f"building the engine ({run_.model} on {run_.gpu})")
    llm, results["build_s"] = build(model, args)
    progress(f"a cold start in a new process (the engine built here in {fmt_s(results['build_s'])})")
    results["cold_start"] = cold_start(model, args.device, engine_options(args))
    rows = results["sleep"] = {}
    progress("level 1, the first sleep after start-up")
    rows["level1_first"] = sleep_row(llm, 1, "level 1, first sleep after start-up")
    progress("level 1, re-sleep with the weights unchanged")
    rows["level1_resleep"] = sleep_row(llm, 1, "level 1, re-sleep (weights unchanged)")
    llm.reload_weights()  # a weight write: the next sleep copies the weights again
    progress("level 1 after a weight write")
    rows["level1"] = sleep_row(llm, 1, "level 1 after a weight write")
    progress("level 2 + reload_weights")
    rows["level2"] = sleep_row(llm, 2, "level 2 (+ reload_weights)")
    results["weights"] = weight_rows(llm, model)
    exact = harness_and_soak(llm, args, results)
    llm.close()
    out = console()
    out.print(run_.header())
    print_sleep(out, run_, results)
    print_weights(out, run_, results)
    print_cold_starts(out, run_, {"cold start in a new process": results["cold_start"]})
    print_harness(out, results)
    return exact


def print_sleep(out, run_: Run, r: dict) -> None:
    link, bare = r["link_gbps"], r["bare_context_bytes"]
    goals = {"level1_first": run_.goal("sleep <= 400 ms"), "level1_resleep": run_.goal("sleep <= 50 ms")}
    rows = []
    for key, f in r["sleep"].items():
        sleep_rate = f["sleep_copied_bytes"] / f["sleep_s"] if f["sleep_s"] else None
        wake_rate = f["wake_copied_bytes"] / f["wake_s"] if f["wake_s"] else None
        rows.append([f["name"], fmt_bytes(f["asleep_bytes"] - bare, signed=True), fmt_s(f["sleep_s"]),
                     fmt_bytes(f["sleep_copied_bytes"]), fmt_rate(sleep_rate),
                     fmt_pct(sleep_rate, link.get("d2h", 0) * 1e9), fmt_s(f["wake_s"]),
                     fmt_bytes(f["wake_copied_bytes"]), fmt_rate(wake_rate),
                     fmt_pct(wake_rate, link.get("h2d", 0) * 1e9), fmt_s(f["reload_s"]) if f["reload_s"] else "",
                     goals.get(key, "")])
    link_text = ", ".join(f"{k} {fmt_rate(v * 1e9)}" for k, v in link.items()) or "not measured on CPU"
    awake = r["sleep"]["level1_first"]["awake_bytes"]
    out.print(table(f"sleep and wake: {fmt_bytes(awake)} in use awake, bare context {fmt_bytes(bare)}",
                    ["case", "asleep - bare", "sleep", "copied", "rate", "of link", "wake", "copied", "rate",
                     "of link", "+ reload", "goal"], rows,
                    caption=f"pinned host link: {link_text}; sleep: the memory layer's time (its Report), wake: "
                            "wall time of wake_up"))
    f = r["sleep"]["level1"]
    out.print(f"asleep at level 1: {fmt_bytes(f['asleep_tagged_bytes'])} still mapped in tags, "
              f"{fmt_bytes(f['asleep_default_pool_bytes'])} in PyTorch's default pool (untagged), "
              f"{fmt_bytes(f['asleep_other_bytes'])} outside any allocator (context, streams, kernel code)")
    out.print(table("memory per tag, awake", ["tag", "resident", "in tensors"],
                    [[tag, fmt_bytes(t["resident_bytes"]), fmt_bytes(t["allocated_bytes"])]
                     for tag, t in f["tags_awake"].items()]))
    wake = r["sleep"]["level1"]["wake_s"]
    if "cold_start" in r and wake:
        out.print(f"a cold start against a level-1 wake: {r['build_s'] / wake:.0f}x in this process "
                  f"({fmt_s(r['build_s'])}), {r['cold_start']['total_s'] / wake:.0f}x as a new process "
                  f"({fmt_s(r['cold_start']['total_s'])})")


# ---- weights: reload, level-2 wake + reload ---------------------------------------------------------------
def weight_rows(llm, model: str) -> dict:
    """`reload_weights()` seconds and GB/s, page cache warm (best of 2) and cold; then a level-2 sleep's wake +
    reload, twice (the first level-2 sleep also gives back the weights' reserved host copy)."""
    files, nbytes = checkpoint_files(model), sum(tensor_bytes(model).values())
    device = llm.config.device

    def reload() -> float:
        start = time.perf_counter()
        llm.reload_weights()
        sync(device)
        return time.perf_counter() - start

    progress("reload_weights, page cache warm and cold")
    warm_page_cache(files)
    warm = min(reload() for _ in range(2))
    drop_page_cache(files)
    cold = reload()
    rows = {"checkpoint_bytes": nbytes, "reload_warm_s": warm, "reload_cold_s": cold}
    for key in ("level2_wake_reload", "level2_wake_reload_again"):
        progress("level-2 sleep, wake + reload_weights")
        warm_page_cache(files)
        llm.sleep(2)
        start = time.perf_counter()
        llm.wake_up()
        woke = time.perf_counter()
        llm.reload_weights()
        sync(device)
        rows[key] = {"wake_s": woke - start, "reload_s": time.perf_counter() - woke,
                     "total_s": time.perf_counter() - start}
    return rows


def print_weights(out, run_: Run, r: dict) -> None:
    w = r["weights"]
    nbytes = w["checkpoint_bytes"]
    rows = [["reload_weights, page cache warm", fmt_s(w["reload_warm_s"]), fmt_rate(nbytes / w["reload_warm_s"]),
             run_.goal(">= 30 GB/s")],
            ["reload_weights, page cache cold", fmt_s(w["reload_cold_s"]), fmt_rate(nbytes / w["reload_cold_s"]), ""]]
    for key, label in (("level2_wake_reload", "level-2 wake + reload"),
                       ("level2_wake_reload_again", "level-2 wake + reload, again (no host copy left)")):
        f = w[key]
        rows.append([f"{label} (wake {fmt_s(f['wake_s'])}, reload {fmt_s(f['reload_s'])})", fmt_s(f["total_s"]),
                     "", run_.goal("<= 800 ms") if key.endswith("again") else ""])
    if "answers_unchanged" in w:
        rows.append(["answers after the reloads", "unchanged" if w["answers_unchanged"] else "CHANGED", "", ""])
    out.print(table(f"weights: {fmt_bytes(nbytes)} checkpoint", ["case", "seconds", "rate", "goal"], rows))


def run_loader(model: str, args: argparse.Namespace, run_: Run, results: dict) -> bool:
    """The weight rows, the greedy answers before and after them compared; then the cold starts."""
    from torpor import SamplingParams
    from torpor.testing import differences, fixed_requests, run_round

    progress(f"building the engine ({run_.model} on {run_.gpu})")
    llm, results["build_s"] = build(model, args)
    requests = [(p, SamplingParams(temperature=0.0, max_tokens=sp.max_tokens, ignore_eos=True))
                for p, sp in fixed_requests(8, vocab_size(model), max_prompt=min(64, args.max_model_len - 17),
                                               max_tokens=16)]
    before = run_round(llm, requests)
    results["weights"] = weight_rows(llm, model)
    results["weights"]["answers_unchanged"] = not differences(before, run_round(llm, requests))
    llm.close()
    del llm
    release(args.device)
    results["cold_starts"] = cold_starts(model, args, args.cold_starts)
    out = console()
    out.print(run_.header())
    print_weights(out, run_, results)
    print_cold_starts(out, run_, results["cold_starts"])
    return results["weights"]["answers_unchanged"]


# ---- cold starts ------------------------------------------------------------------------------------------
def cold_starts(model: str, args: argparse.Namespace, repeats: int = 3) -> dict:
    """New processes to their first token: one profiling its KV-sizing step (kv_profile_cache off), then the
    default reading it back (`repeats` starts, the median's phases), then the default with the checkpoint's
    page cache dropped first."""
    options = engine_options(args)
    starts = {}
    progress("cold start profiling its KV-sizing step")
    starts["profiling the KV-sizing step"] = cold_start(model, args.device, {**options, "kv_profile_cache": False})
    runs = []
    for i in range(repeats):
        progress(f"cold start, the default ({i + 1}/{repeats})")
        runs.append(cold_start(model, args.device, options))
    starts[f"the default, median of {repeats}"] = median_run(runs)
    progress("cold start, page cache dropped first")
    starts["the default, page cache cold"] = cold_start(model, args.device, options, drop_cache=True)
    return starts


def run_cold_starts(model: str, args: argparse.Namespace, run_: Run, results: dict) -> bool:
    """One start not counted (it leaves what a restart finds: the KV-sizing step's record, Triton's kernels,
    the bytecode), then `cold_starts`."""
    progress("a first cold start, not counted")
    cold_start(model, args.device, engine_options(args))
    results["cold_starts"] = cold_starts(model, args, args.cold_starts)
    out = console()
    out.print(run_.header())
    print_cold_starts(out, run_, results["cold_starts"])
    return True


def print_cold_starts(out, run_: Run, starts: dict[str, dict]) -> None:
    """One column per start: its seconds by phase (imports, the LLM's start-up phases, the rest of the
    start-up, the first token), the whole from launch to first token last."""
    names = list(dict.fromkeys(p for s in starts.values() for p in s["startup_phases"] if p != "total"))
    names = [n for n in names if n not in BESIDE_PHASES] + [n for n in names if n in BESIDE_PHASES]
    rows = [["imports (torch, torpor)", *(fmt_s(s["imports_s"]) for s in starts.values())]]
    for name in names:
        label = f"  {name} ({where})" if (where := BESIDE_PHASES.get(name)) else name
        rows.append([label, *(fmt_s(s["startup_phases"].get(name)) for s in starts.values())])
    rows.append(["start-up outside the phases above", *(fmt_s(s["engine_other_s"]) for s in starts.values())])
    rows.append(["first token", *(fmt_s(s["first_token_s"]) for s in starts.values())])
    rows.append(["launch to first token", *(fmt_s(s["total_s"]) for s in starts.values())])
    goal = run_.goal("<= 4 s for the default")
    out.print(table("cold start in a new process, by phase", ["phase", *starts], rows, caption=goal or None))


# ---- the bit-exact harness and the soak -------------------------------------------------------------------
def harness_requests(args: argparse.Namespace, model: str) -> list:
    """`--requests` mixed requests whose prompt + 32 output tokens fit max_model_len."""
    from torpor.testing import fixed_requests

    return fixed_requests(args.requests, vocab_size(model), max_prompt=min(256, args.max_model_len - 33),
                          max_tokens=32)


def harness_and_soak(llm, args: argparse.Namespace, results: dict, cases=None, soak_cases=None) -> bool:
    """The bit-exact harness over `cases` (default: every scenario of torpor.testing), then `--soak-cycles`
    cycles over `soak_cases`; their figures into `results`. Whether every round was exact."""
    from torpor.testing import run_harness, soak

    requests = harness_requests(args, llm.config.model)
    progress(f"the bit-exact harness, {len(requests)} requests")
    harness = run_harness(llm, requests, cases=cases, log=lambda line: progress(f"  {line}"))
    results["harness"] = [{"name": s.name, "mismatches": s.mismatches, "requests": len(requests),
                           "sleep_s": s.sleep_s, "wake_s": s.wake_s, "asleep_bytes": s.asleep_bytes}
                          for s in harness]
    progress(f"the soak, {args.soak_cycles} cycles")
    start = time.perf_counter()
    soaked = soak(llm, requests[:16], args.soak_cycles, log=lambda line: progress(f"  {line}"), cases=soak_cases)
    results["soak"] = {"cycles": soaked.cycles, "exact": soaked.exact_cycles, "seconds": time.perf_counter() - start,
                       "device_drift_bytes_per_cycle": soaked.drift(soaked.device_bytes) * MiB,
                       "host_rss_drift_bytes_per_cycle": soaked.drift(soaked.host_rss_bytes) * MiB,
                       "device_bytes_first_last": [soaked.device_bytes[0], soaked.device_bytes[-1]],
                       "host_rss_bytes_first_last": [soaked.host_rss_bytes[0], soaked.host_rss_bytes[-1]]}
    return all(h["mismatches"] == 0 for h in results["harness"]) and soaked.exact_cycles == soaked.cycles


def print_harness(out, r: dict) -> None:
    rows = [[h["name"], "exact" if h["mismatches"] == 0 else f"{h['mismatches']}/{h['requests']} differ",
             fmt_s(h["sleep_s"]), fmt_s(h["wake_s"]), fmt_bytes(h["asleep_bytes"])] for h in r["harness"]]
    out.print(table("the bit-exact harness: every answer against the first awake round",
                    ["scenario", "answers", "sleep", "wake", "asleep"], rows))
    s = r["soak"]
    first, last = s["device_bytes_first_last"], s["host_rss_bytes_first_last"]
    out.print(f"soak: {s['exact']}/{s['cycles']} cycles exact in {fmt_s(s['seconds'])}; drift per cycle (slope of "
              f"each scenario's readings, the largest): device {fmt_bytes(s['device_drift_bytes_per_cycle'], True)}, "
              f"host RSS {fmt_bytes(s['host_rss_drift_bytes_per_cycle'], True)}; device {fmt_bytes(first[0])} -> "
              f"{fmt_bytes(first[1])}, host RSS {fmt_bytes(last[0])} -> {fmt_bytes(last[1])}")


def run_soak(model: str, args: argparse.Namespace, run_: Run, results: dict) -> bool:
    progress(f"building the engine ({run_.model} on {run_.gpu})")
    llm, results["build_s"] = build(model, args)
    exact = harness_and_soak(llm, args, results)
    llm.close()
    out = console()
    out.print(run_.header())
    print_harness(out, results)
    return exact


# ---- the KV-cache curve -----------------------------------------------------------------------------------
def run_kv_curve(model: str, args: argparse.Namespace, run_: Run, results: dict) -> bool:
    """Per `gpu_memory_utilization` of KV_CURVE, one engine (closed before the next), its host copies reserved
    first: the first level-1 sleep and a full wake, then a re-sleep, the wake of the weights alone
    (`wake_up(["weights"])`, which also restores the runtime state) and the KV cache's."""
    rows = results["kv_curve"] = []
    for utilization in KV_CURVE:
        progress(f"gpu_memory_utilization {utilization}: building the engine")
        llm, build_s = build(model, args, gpu_memory_utilization=utilization)
        wait_for_reservation(llm)
        kv_bytes = llm.memory_usage()["tags"]["kv_cache"]["reserved_bytes"]
        first = llm.sleep(1)
        full = timed(llm.wake_up)
        resleep = llm.sleep(1)
        weights = timed(lambda llm=llm: llm.wake_up(["weights"]))
        kv = timed(lambda llm=llm: llm.wake_up(["kv_cache"]))
        rows.append({"gpu_memory_utilization": utilization, "kv_cache_bytes": kv_bytes, "build_s": build_s,
                     "first_sleep_s": first.seconds, "first_sleep_copied_bytes": first.bytes_copied,
                     "wake_s": full[0], "wake_copied_bytes": full[1].report.bytes_copied,
                     "resleep_s": resleep.seconds, "wake_weights_s": weights[0],
                     "wake_weights_copied_bytes": weights[1].report.bytes_copied, "wake_kv_cache_s": kv[0]})
        llm.close()
        del llm
        release(args.device)
    out = console()
    out.print(run_.header())
    out.print(table("level 1 by KV-cache size (gpu_memory_utilization)",
                    ["utilization", "KV cache", "first sleep", "wake (all)", "copied", "re-sleep", "wake weights",
                     "copied", "then wake kv_cache"],
                    [[f"{r['gpu_memory_utilization']:.2f}", fmt_bytes(r["kv_cache_bytes"]),
                      fmt_s(r["first_sleep_s"]), fmt_s(r["wake_s"]), fmt_bytes(r["wake_copied_bytes"]),
                      fmt_s(r["resleep_s"]), fmt_s(r["wake_weights_s"]), fmt_bytes(r["wake_weights_copied_bytes"]),
                      fmt_s(r["wake_kv_cache_s"])] for r in rows],
                    caption="sleeps: the memory layer's time (Report.seconds); wakes: wall time of wake_up"))
    return True


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


# ---- levels 3 and 4 -------------------------------------------------------------------------------------
def start_ups(model: str, args: argparse.Namespace, rounds: int = 2) -> dict:
    """Launch to first token in a new process, reserving the host copies and not: one warm-up start first (the
    page cache, Triton's cache: the first start pays for them whichever option it has), then the two options
    alternated `rounds` times; the medians."""
    options = {"reserving": engine_options(args),
               "not_reserving": {**engine_options(args), "reserve_host_copies": False}}
    progress("a first start-up in a new process, not counted")
    cold_start(model, args.device, options["not_reserving"])
    times: dict[str, list[float]] = {label: [] for label in options}
    for i in range(rounds):
        for label, option in options.items():
            progress(f"start-up {label.replace('_', ' ')} host copies ({i + 1}/{rounds})")
            times[label].append(cold_start(model, args.device, option)["total_s"])
    return {f"start_s_{label}": median(values) for label, values in times.items()}


def level3_row(llm, level: int, name: str) -> dict:
    """One sleep at `level` and a full wake (+ reload after 2 and 4), wall seconds, with NVML's reading of
    this process's device memory (taken by the checkpoint helper) awake and asleep, and the driver's share of
    the checkpoint and of the restore."""
    from torpor.memory import checkpoint

    awake_nvml = checkpoint.device_readings()
    start = time.perf_counter()
    report = llm.sleep(level)
    sleep_s = time.perf_counter() - start
    asleep, asleep_nvml = llm.memory_usage(), checkpoint.device_readings()
    taken = checkpoint.current()  # the context's checkpoint (levels 3 and 4)
    start = time.perf_counter()
    llm.wake_up()
    if level in (2, 4):
        llm.reload_weights()
    sync(llm.config.device)
    wake_s = time.perf_counter() - start
    restored = checkpoint.last_restore() if taken is not None else None
    return {"name": name, "level": level, "sleep_s": sleep_s, "wake_s": wake_s,
            "copied_bytes": report.bytes_copied if report else 0,
            "device_asleep_bytes": asleep["device_used_bytes"], "context_released": asleep["context_released"],
            "process_awake_bytes": awake_nvml.get("process_bytes"),
            "process_asleep_bytes": asleep_nvml.get("process_bytes"),
            "checkpoint_s": taken.seconds if taken else None, "checkpoint_driver_s": taken.driver_s if taken else {},
            "restore_s": restored.seconds if restored else None,
            "restore_driver_s": restored.driver_s if restored else {}}


def run_level3(model: str, args: argparse.Namespace, run_: Run, results: dict) -> bool:
    from torpor.memory import MemoryManager
    from torpor.testing.harness import level3_scenarios, level3_soak_scenarios

    probe = MemoryManager(args.device)  # a clear error now if the driver cannot checkpoint this process
    try:
        probe.check_checkpoint()
    finally:
        probe.close()
    results.update(start_ups(model, args))
    progress(f"building the engine ({run_.model} on {run_.gpu})")
    llm, results["build_s"] = build(model, args)
    results["reservation"] = wait_for_reservation(llm)
    rows = results["rows"] = []
    for level, name in ((1, "level 1, first sleep (copies reserved)"), (1, "level 1, re-sleep (weights unchanged)"),
                        (1, "level 1 after a weight write"), (3, "level 3"), (3, "level 3, again"),
                        (4, "level 4 (+ reload_weights)")):
        if name == "level 1 after a weight write":
            llm.reload_weights()  # what update_weights, a push and reload_weights declare: the copy is stale
        progress(name)
        rows.append(level3_row(llm, level, name))
    exact = harness_and_soak(llm, args, results, level3_scenarios(), level3_soak_scenarios())
    llm.close()
    print_level3(run_, results)
    return exact


def print_level3(run_: Run, r: dict) -> None:
    out = console()
    out.print(run_.header())
    slower = r["start_s_reserving"] / r["start_s_not_reserving"] - 1
    reservation = r["reservation"]
    out.print(table("start-up to the first token in a new process (medians)", ["case", "seconds", "goal"], [
        ["reserving the host copies (the default)", fmt_s(r["start_s_reserving"]), ""],
        ["not reserving them", fmt_s(r["start_s_not_reserving"]), ""],
        ["reserving against not", f"{slower:+.1%}", run_.goal("<= +5%")]],
        caption=f"host copies reserved in the background: {fmt_bytes(reservation['reserved_bytes'])}, done "
                f"{fmt_s(reservation['waited_s'])} after the engine was built in {fmt_s(r['build_s'])}"))
    level1_wake = r["rows"][0]["wake_s"]
    goals = {0: run_.goal("sleep <= 400 ms"), 1: run_.goal("sleep <= 50 ms"),
             3: run_.goal(f"0 B asleep in the process; wake <= {fmt_s(level1_wake + 0.3)} (level 1 + 300 ms)")}
    rows = [[row["name"], fmt_s(row["sleep_s"]), fmt_bytes(row["copied_bytes"]), fmt_s(row["wake_s"]),
             fmt_bytes(row["process_awake_bytes"]), fmt_bytes(row["process_asleep_bytes"]),
             fmt_bytes(row["device_asleep_bytes"]), fmt_s(row["checkpoint_s"]), fmt_s(row["restore_s"]),
             goals.get(i, "")] for i, row in enumerate(r["rows"])]
    out.print(table("sleep levels 1, 3 and 4",
                    ["case", "sleep", "copied", "wake", "process awake (NVML)", "process asleep (NVML)",
                     "device in use asleep", "context checkpoint", "its restore", "goal"], rows,
                    caption="process '-': no NVML reading; 0 B awake: NVML does not list this process (another PID "
                            "namespace), and 0 B asleep then proves nothing. The driver's share of the checkpoint "
                            "and the restore: --json"))
    print_harness(out, r)
