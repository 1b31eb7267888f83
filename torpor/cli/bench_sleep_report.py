"""`torpor bench sleep`'s report: the figures of torpor/cli/bench_sleep.py as tables and lines, each number in
a unit chosen for its magnitude, a goal only where the run is the one the goal is for (a GPU)."""

from __future__ import annotations

import sys

from torpor.cli import units

MiB = 2**20


def report_level3(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160) if not sys.stdout.isatty() else Console()
    slower = r["start_s_reserving"] / r["start_s_not_reserving"] - 1
    console.print(f"{r['model']} on {r['device']}; bare context {r['bare_mib']:.0f} MiB; {_link(r)}; "
                  f"start-up to first token {units.seconds(r['start_s_reserving'])} reserving host copies, "
                  f"{units.seconds(r['start_s_not_reserving'])} not ({slower:+.1%}; goal <= +5%); reserved "
                  f"{units.size(r['reservation']['gib'] * 2**30)} in {units.seconds(r['reservation']['seconds'])}")
    table = Table(title="sleep levels 1, 3, 4 (goals: first sleep <= 0.4 s, re-sleep <= 0.05 s, level 3 asleep "
                        "0 MiB in the process, level-3 wake <= level-1 wake + 0.3 s)")
    for col in ("case", "sleep", "copied MiB", "wake", "process awake MiB (NVML)", "process asleep MiB (NVML)",
                "device in use asleep MiB"):
        table.add_column(col, justify="right")
    for row in r["rows"]:
        table.add_row(row["name"], units.seconds(row["sleep_s"]), f"{row['copied_mib']:.0f}",
                      units.seconds(row["wake_s"]),
                      f"{row['process_awake_mib']:.0f}", f"{row['process_asleep_mib']:.0f}", f"{row['asleep_mib']:.0f}")
    console.print(table)
    console.print("(process MiB -1: no NVML reading; 0 while awake: NVML does not list this PID, e.g. another PID "
                  "namespace, and the asleep 0 proves nothing)")
    for h in r["harness"]:
        verdict = "exact" if h["mismatches"] == 0 else f"{h['mismatches']} requests differ"
        console.print(f"harness {h['name']}: {verdict} (sleep {units.seconds(h['sleep_s'])}, wake "
                      f"{units.seconds(h['wake_s'])})")
    s = r["soak"]
    console.print(f"level-3 soak: {s['exact']}/{s['cycles']} cycles exact, device drift {s['device_slope_mib']:+.3f} "
                  f"MiB/cycle, host RSS drift {s['host_rss_slope_mib']:+.3f} MiB/cycle")


ALTERNATED_LABELS = {"loaded_first": "the old path (loaded first, every size warmed up)",
                     "overlapped": "loaded beside, every size warmed up",
                     "overlapped_one_warmup": "the default (loaded beside, one warm-up)"}


def report_loader(r: dict) -> None:
    from rich.console import Console

    console = Console(width=160) if not sys.stdout.isatty() else Console()
    if "loader" in r:
        report_reloads(console, r)
    for key, label in (("cold_start_phases_profiling", "profiling its step"),
                       ("cold_start_phases", "the step's memory read back"),
                       ("cold_start_phases_overlapped", "read back, the weights loaded beside the KV sizing and "
                                                        "graph capture, every size warmed up"),
                       ("cold_start_phases_default", "read back, the default (loaded beside, one warm-up)"),
                       ("cold_start_phases_one_warmup", "read back, loaded first, only the largest graph size "
                                                        "warmed up"),
                       ("cold_start_phases_profiled", "read back, the default under cProfile (slower: the "
                                                      "profiler's cost)"),
                       ("cold_start_phases_cold_cache", "read back, the page cache dropped first"),
                       ("cold_start_phases_cold_cache_overlapped", "read back, the page cache dropped first, the "
                                                                   "default")):
        if key in r:
            c = r[key]
            phases = ", ".join(f"{k} {units.seconds(v)}" for k, v in c["phases"].items())
            read_back = "read back" if c.get("kv_profile_read_back") else "measured"
            cache = f"bytecode cache {c['bytecode_cache']}" if c.get("bytecode_cache") else "no bytecode cache"
            console.print(f"cold start in a new process, {label}: {units.seconds(c['total_s'])} (step memory "
                          f"{read_back}, {cache}); phases: {phases}")
            if c.get("graph_capture"):
                sizes = ", ".join(f"{g['batch_size']}: {units.seconds(g['warm_up_s'])} + "
                                  f"{units.seconds(g['capture_s'])}" for g in c["graph_capture"])
                console.print(f"  graph capture by batch size (warm-up + capture): {sizes}")
            if c.get("weight_load_beside_s") is not None:
                console.print(f"  the weight load on its own thread, beside the KV sizing and graph capture: "
                              f"{units.seconds(c['weight_load_beside_s'])} ({c['load_threads_beside']} reader "
                              "threads)")
            for line in c.get("profile", []):
                console.print(f"  {line}", highlight=False, markup=False)
    if "cold_start_alternated" in r:
        for name, runs in r["cold_start_alternated"].items():
            totals = sorted(run["total_s"] for run in runs)
            capture = sorted(run["phases"].get("cuda_graph_capture", 0.0) for run in runs)
            median = totals[len(totals) // 2]
            label = ALTERNATED_LABELS.get(name, name)
            console.print(f"cold start, read back, {label}, alternated: median {units.seconds(median)} "
                          f"(runs {', '.join(units.seconds(t) for t in totals)}; graph capture median "
                          f"{units.seconds(capture[len(capture) // 2])}) {_goal(r, median, 4)}")


def report_reloads(console, r: dict) -> None:
    from rich.table import Table

    loader = r["loader"]
    nbytes = loader["checkpoint_gb"] * 1e9
    table = Table(title=f"reload of {units.size(nbytes)} ({r['model']} on {r['device']}): plain vs staged")
    for col in ("path", "page cache", "time", "rate"):
        table.add_column(col, justify="right")
    for key, row in loader["reload"].items():
        path, cache = key.rsplit("_", 1)
        label = {"old": "plain (safe_open)", "new": "staged (torpor)"}.get(path, path)
        table.add_row(label, cache, units.seconds(row["seconds"]), units.rate(nbytes, row["seconds"]) or "-")
    console.print(table)
    console.print(f"level-2 wake + reload: {wake_reload(loader['level2_wake_reload'])}")
    if "level2_wake_reload_again" in loader:
        w = loader["level2_wake_reload_again"]
        console.print(f"level-2 wake + reload, again: {wake_reload(w)} {_goal(r, w['total_s'], 0.8)}")
    if "answers_unchanged" in loader:
        console.print(f"answers after the reloads: {'unchanged' if loader['answers_unchanged'] else 'CHANGED'}")


def report(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160) if not sys.stdout.isatty() else Console()
    console.print(f"{r['model']} on {r['device']}; bare context {r['bare_mib']:.0f} MiB; {_link(r)}; cold start "
                  f"{units.seconds(r['cold_start_s'])} in process, {units.seconds(r['cold_start_process_s'])} new "
                  "process")
    table = Table(title="device memory (MiB) and sleep/wake")
    for col in ("case", "awake", "asleep", "asleep - bare", "sleep", "copied", "at link speed", "wake",
                "cold start / wake (in process)", "(new process)"):
        table.add_column(col, justify="right")
    d2h = r["link_gbps"].get("d2h", 0)
    for name in ("untagged_runtime", "level1_first", "level1", "level2"):
        if name not in r:
            continue
        f = r[name]
        ideal = units.seconds(f["sleep_copied_mib"] * MiB / (d2h * 1e9)) if d2h else "-"
        over_bare = f["asleep_mib"] - r["bare_mib"]
        ratios = [f"{r[key] / f['wake_s']:.0f}x" if f["wake_s"] else "-"
                  for key in ("cold_start_s", "cold_start_process_s")]
        table.add_row(name, f"{f['awake_mib']:.0f}", f"{f['asleep_mib']:.0f}", f"{over_bare:+.0f}",
                      units.seconds(f["sleep_s"]), units.size(f["sleep_copied_mib"] * MiB), ideal,
                      units.seconds(f["wake_s"]), *ratios)
    console.print(table)
    f = r["level1"]
    console.print(f"asleep at level 1: {f['asleep_tagged_mib']:.0f} MiB still mapped in tags, "
                  f"{f['asleep_untagged_pool_mib']:.0f} MiB in PyTorch's default pool (graph RNG state, untagged), "
                  f"{f['asleep_other_mib']:.0f} MiB outside any allocator (context, streams, kernel code)")
    for tag, t in r["level1"]["tags"].items():
        console.print(f"  {tag}: {t['awake_mib']:.1f} MiB resident awake")
    for h in r["harness"]:
        verdict = "exact" if h["mismatches"] == 0 else f"{h['mismatches']} requests differ"
        console.print(f"harness {h['name']}: {verdict}")
    report_loader(r)
    s = r["soak"]
    console.print(f"soak: {s['exact']}/{s['cycles']} cycles exact, device drift {s['device_slope_mib']:+.3f} "
                  f"MiB/cycle, host RSS drift {s['host_rss_slope_mib']:+.3f} MiB/cycle (slope of each scenario's "
                  "readings, the largest)")


def _link(r: dict) -> str:
    """The pinned host link's measured rates, or that there is none (CPU)."""
    if not r["link_gbps"]:
        return "no host link (CPU)"
    return "pinned link " + ", ".join(f"{k} {units.rate(v * 1e9, 1)}" for k, v in r["link_gbps"].items())


def _goal(r: dict, seconds: float, target_s: float) -> str:
    """A time's goal, stated only on a GPU run (the goals are for GPU figures)."""
    return units.goal(f"<= {target_s:g} s", seconds <= target_s, r["device"].startswith("cuda"))


def wake_reload(w: dict) -> str:
    return (f"{units.seconds(w['total_s'])} (wake {units.seconds(w['wake_s'])}, reload "
            f"{units.seconds(w['reload_s'])})")
