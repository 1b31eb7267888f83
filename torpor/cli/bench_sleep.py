"""`torpor bench sleep`: the engine's sleep mode measured in one run.

For one model (default: the synthetic qwen3-8b geometry on GPU, the tiny model on CPU) with CUDA
graphs: device memory awake and asleep, per tag, against the bare CUDA context; the same with the
runtime state left untagged (an engine that does not tag it) to show the saving; sleep and wake
seconds at levels 1 and 2 against bytes / measured pinned bandwidth; a full wake against a cold
start of the same engine (load + profiling + graph capture); then the bit-exact harness
(`--requests`, default 64) and a soak of `--soak-cycles` cycles.

`--level3` measures levels 3 and 4 instead (CUDA only): start-up with and without the host copies reserved in the
background (after one warm-up start, alternated twice, medians), the first level-1 sleep once they are, a
re-sleep that keeps the weights' clean host copy, a sleep after a weight write, levels 3 and 4 (the CUDA context
released: the process's device memory by NVML, sleep and wake seconds), the bit-exact harness over the level-3
paths, and a soak of `--soak-cycles` cycles alternating level 3 with levels 1 and 2.

Weights (`--loader-only` runs just these): the same reload through the plain loader (safe_open, one
tensor at a time) and the staged loader (parallel reads into pinned staging buffers, async copies) side
by side, with the page cache warm (every shard read once just before) and cold (posix_fadvise
DONTNEED on every shard first; no effect on tmpfs); the staged reload with other numbers and sizes of
staging buffers (`STAGING_SWEEP`, to choose the default from); a level-2 wake followed by a reload; and
cold starts in a new process split into their phases (TORPOR_DEBUG's start-up lines): one profiling its
KV-sizing step (TORPOR_KV_PROFILE_CACHE=0, the old path), one reading it back (engine/profile_cache.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import time

import torch

from torpor.cli import units
from torpor.cli.bench_sleep_report import report, report_level3, report_loader, wake_reload

MiB = 2**20


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sleep", help="sleep-mode memory, speed, bit-exactness and soak of the engine",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder or preset name (default: qwen3-8b on GPU, "
                   "the tiny model on CPU); presets are generated into the cache on first use")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--requests", type=int, default=64, help="requests in the bit-exact batch")
    p.add_argument("--soak-cycles", type=int, default=20)
    p.add_argument("--skip-untagged", action="store_true", help="skip the untagged-runtime comparison")
    p.add_argument("--soak-only", action="store_true", help="only the bit-exact harness and the soak (a long soak "
                   "with --soak-cycles: every cycle exact, device and host-RSS slopes)")
    p.add_argument("--loader-only", action="store_true", help="only the weight-loading rows (reload old vs new "
                   "path, level-2 wake + reload, cold start phases)")
    p.add_argument("--cold-start-only", action="store_true", help="only the cold starts in new processes, by phase "
                   "(one profiling the KV-sizing step, one reading it back, one without the bytecode cache)")
    p.add_argument("--cold-start-rounds", type=int, default=3, metavar="N",
                   help="cold starts: rounds of the alternated starts, each start kind once per round (default: 3)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--level3", action="store_true", help="measure sleep levels 3/4, the first sleep with "
                   "reserved host copies and the re-sleep without copying (CUDA only; see above)")
    p.set_defaults(func=run)


def resolve_model(name: str | None, device: str) -> str:
    from pathlib import Path

    from torpor.env import Env
    from torpor.synthetic import PRESETS, default_model_path

    if name is None:
        name = "qwen3-8b" if device.startswith("cuda") else None
    if name is None:
        return str(default_model_path())
    if name not in PRESETS:
        return name
    from torpor.cli.bench_decode import checkpoint

    return str(checkpoint(name, Path(Env.read().cache_dir) / "models"))


def build(model: str, args: argparse.Namespace, **options):
    from torpor.engine import LLM

    start = time.perf_counter()
    llm = LLM(model, device=args.device, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              **options)
    return llm, time.perf_counter() - start


PHASE_LINE = re.compile(r"start-up phase (\w+): ([0-9.]+) s")
CAPTURE_LINE = re.compile(r"cuda graph batch size (\d+): warm-up ([0-9.]+) s, capture ([0-9.]+) s")
BESIDE_LINE = re.compile(r"weight load beside the start-up: ([0-9.]+) s, waited for ([0-9.]+) s \((\d+) reader")


def cold_start_phases(model: str, args: argparse.Namespace, options: str = "", kv_profile_cache: bool = True,
                      bytecode_cache: bool = True, overlap_load: bool = True, cold_cache: bool = False,
                      capture_warmups: str = "first", profile_top: int = 0) -> dict:
    """Seconds from launching a new Python process to its first generated token with the same engine
    options: what restarting costs instead of a wake (Triton's disk cache and the OS page cache are warm,
    as for a restart), timed by phase: imports (measured inside), the engine's start-up phases
    (TORPOR_DEBUG=1 lines), the rest of the engine's set-up, the first token. The process starts as the
    `torpor` command does (lazy.use_bytecode_cache first) unless `bytecode_cache` is False. With `overlap_load`
    (TORPOR_OVERLAP_LOAD=1, the engine's default) the weights load on a thread of their own beside the KV sizing and
    the graph capture: the phases then hold the main thread's `weight_load_plan` and `weight_load_wait`, and
    `weight_load_beside_s` the load's own seconds; without, `weight_load` comes first. `cold_cache`: the
    checkpoint's pages dropped from the page cache just before the start (`drop_page_cache`; no effect on tmpfs).
    `capture_warmups`: TORPOR_CAPTURE_WARMUPS ("first", the engine's default: only the largest graph size warmed up
    before its capture; "every": each size, the old path).
    `profile_top`: the engine's start-up also runs under cProfile, and `profile` holds the functions with the most
    time of their own (the first N of pstats' table, by tottime)."""
    import os
    import subprocess

    bytecode = "from torpor.lazy import use_bytecode_cache; print('BYTECODE', use_bytecode_cache(), flush=True); "
    code = ("import time; t0 = time.perf_counter(); " + (bytecode if bytecode_cache else "")
            + "import torch; from torpor.engine import LLM, SamplingParams; "
            "print('IMPORTS', time.perf_counter() - t0, flush=True); "
            + ("import cProfile; profiler = cProfile.Profile(); profiler.enable(); " if profile_top else "")
            + f"llm = LLM({model!r}, device={args.device!r}, max_num_seqs={args.max_num_seqs}, "
            f"max_model_len={args.max_model_len}{options}); t1 = time.perf_counter(); "
            + ("profiler.disable(); import pstats; print('PROFILE_BEGIN'); "
               f"pstats.Stats(profiler).sort_stats('tottime').print_stats({profile_top}); print('PROFILE_END'); "
               if profile_top else "")
            + "print('ENGINE', t1 - t0, flush=True); llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1)); "
            "print('FIRST_TOKEN', time.perf_counter() - t1, flush=True); print('READY', time.time(), flush=True)")
    if cold_cache:
        from torpor.engine.weights.index import checkpoint_files

        drop_page_cache(checkpoint_files(model))
    start = time.time()  # the child reports when its first token came: its exit is not start-up
    env = dict(os.environ, TORPOR_DEBUG="1", TORPOR_KV_PROFILE_CACHE="1" if kv_profile_cache else "0",
               TORPOR_OVERLAP_LOAD="1" if overlap_load else "0", TORPOR_CAPTURE_WARMUPS=capture_warmups)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    if "READY" not in out.stdout:
        raise RuntimeError(f"the cold-start process failed (exit {out.returncode}): {out.stderr[-2000:]}")
    total = float([line.split()[1] for line in out.stdout.splitlines() if line.startswith("READY ")][-1]) - start
    values = dict(line.split() for line in out.stdout.splitlines()
                  if line.startswith(("IMPORTS", "ENGINE", "FIRST_TOKEN")))
    phases = {"imports": float(values["IMPORTS"])}
    for name, seconds in PHASE_LINE.findall(out.stderr):
        phases[name] = phases.get(name, 0.0) + float(seconds)
    # The engine's start-up outside its timed phases: model name and config, generation defaults, the runner's
    # stream and staging set-up, scheduler, the host-copy reservation's start.
    phases["engine_other"] = float(values["ENGINE"]) - sum(phases.values())
    phases["first_token"] = float(values["FIRST_TOKEN"])
    # Where cuda_graph_capture goes: per batch size (largest first), the eager warm-up and the capture.
    graphs = [dict(batch_size=int(size), warm_up_s=float(warm), capture_s=float(capture))
              for size, warm, capture in CAPTURE_LINE.findall(out.stderr)]
    cache = [line.split(maxsplit=1)[1] for line in out.stdout.splitlines() if line.startswith("BYTECODE ")]
    beside = BESIDE_LINE.findall(out.stderr)
    profile = out.stdout.split("PROFILE_BEGIN", 1)[-1].split("PROFILE_END", 1)[0] if profile_top else ""
    return dict(total_s=total, phases=phases, kv_profile_read_back="from an earlier start-up" in out.stderr,
                profile=[line.rstrip() for line in profile.splitlines() if line.strip()],
                graph_capture=graphs, bytecode_cache=cache[0] if cache and cache[0] != "None" else None,
                weight_load_beside_s=float(beside[-1][0]) if beside else None,
                load_threads_beside=int(beside[-1][2]) if beside else None)


def drop_page_cache(files) -> None:
    """Ask the kernel to drop the files' cached pages (a cold read follows; no effect on tmpfs)."""
    import os

    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_page_cache(files) -> None:
    """Read every file once (what "page cache warm" means in these rows)."""
    for file in files:
        with open(file, "rb") as f:
            while f.read(64 << 20):
                pass


def loader_figures(llm, model: str, device: str) -> dict:
    """Reload seconds and GB/s, plain loader against the staged one, page cache warm and cold; then a
    level-2 wake + reload. Both loaders write the same parameters; the answers are checked unchanged."""
    from torpor.engine.weights.index import checkpoint_files, read_headers
    from torpor.engine.weights.loader import load_weights_reference

    runner = llm.engine.model_runner
    local = getattr(runner, "local", runner)  # rank 0 under tensor parallelism
    files = checkpoint_files(model)
    nbytes = sum(e.nbytes for e in read_headers(model))

    def timed(fn) -> float:
        _sync(device)
        start = time.perf_counter()
        with local.engine_stream.scope():
            fn()
        _sync(device)
        return time.perf_counter() - start

    paths = {"old": lambda: load_weights_reference(local.model, model), "new": lambda: local.reload_weights(model)}
    instanttensor = _instanttensor_path(local.model, files, device)
    if instanttensor is not None:
        paths["instanttensor"] = instanttensor
    rows = {}
    for cache in ("warm", "cold"):
        for name, fn in paths.items():
            if cache == "warm":
                warm_page_cache(files)
            else:
                drop_page_cache(files)
            seconds = min(timed(fn) for _ in range(2 if cache == "warm" else 1))
            rows[f"{name}_{cache}"] = dict(seconds=seconds, gbps=nbytes / 1e9 / seconds)
            print(f"reload {name} path, page cache {cache}: {units.seconds(seconds)}, {units.rate(nbytes, seconds)}",
                  flush=True)
    sweep = staging_sweep(local.model, model, device, nbytes, timed)
    wake = level2wake_reload(llm, files, device)
    print(f"level-2 wake + reload: {wake_reload(wake)}", flush=True)
    # The first level-2 sleep discards the weights' reserved host copy, whose pinned pages a background thread
    # gives back (~0.1 s/GiB) while the wake runs; an RL loop sleeping at level 2 every step has no copy left.
    again = level2wake_reload(llm, files, device)
    print(f"level-2 wake + reload, again (no host copy left to give back): {wake_reload(again)}", flush=True)
    return dict(checkpoint_gb=nbytes / 1e9, reload=rows, staging_sweep=sweep, level2_wake_reload=wake,
                level2_wake_reload_again=again)


def level2wake_reload(llm, files, device: str) -> dict:
    """One level-2 sleep, then the wake and `reload_weights()` timed (page cache warm)."""
    warm_page_cache(files)
    llm.sleep(2)
    start = time.perf_counter()
    llm.wake_up()
    woke = time.perf_counter()
    llm.reload_weights()
    _sync(device)
    done = time.perf_counter()
    return dict(wake_s=woke - start, reload_s=done - woke, total_s=done - start)


# (staging buffers, MiB each) tried by `staging_sweep`: the loader's default first (weights/staging.py), then
# its neighbours (half / twice the buffers, twice the size) and the former default, 8 x 128 MiB.
STAGING_SWEEP = ((32, 32), (16, 64), (64, 16), (32, 64), (8, 128))


def staging_sweep(model_module, model: str, device: str, nbytes: int, timed) -> dict:
    """The staged reload, page cache warm, with other numbers and sizes of staging buffers (the reader
    threads follow the number, up to the cores): what the default is chosen from. Each set is pinned by an
    untimed load first; the best of two timed loads."""
    from torpor.engine.weights.index import checkpoint_files
    from torpor.engine.weights.loader import load_weights
    from torpor.engine.weights.staging import StagingBuffers

    warm_page_cache(checkpoint_files(model))
    rows = {}
    for count, mib in STAGING_SWEEP:
        staging = StagingBuffers(device, buffer_bytes=mib << 20, count=count)
        try:
            timed(lambda staging=staging: load_weights(model_module, model, staging))
            seconds = min(timed(lambda staging=staging: load_weights(model_module, model, staging)) for _ in range(2))
        finally:
            staging.close()
        rows[f"{count}x{mib}MiB"] = dict(buffers=count, mib=mib, threads=staging.threads, seconds=seconds,
                                         gbps=nbytes / 1e9 / seconds)
        print(f"staged reload with {count} x {mib} MiB buffers ({staging.threads} threads), page cache warm: "
              f"{units.seconds(seconds)}, {units.rate(nbytes, seconds)}", flush=True)
    return rows


def _instanttensor_path(model, files, device: str):
    """The `instanttensor` package's reader (when installed, on CUDA) feeding the same parameters: its
    own GPU ring buffer (outside torpor's memory tags), then one device copy per tensor."""
    try:
        import instanttensor
    except ImportError:
        return None
    if not device.startswith("cuda"):
        return None
    from torpor.engine.weights.loader import load_named_tensors

    def load() -> None:
        index = torch.cuda.current_device()
        with instanttensor.safe_open([str(f) for f in files], framework="pt", device=index, copy=False) as f:
            load_named_tensors(model, f.tensors(), strict=True)

    return load


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def memory_figures(llm, device: str, level: int) -> dict:
    """Device memory awake and asleep at `level`, per tag; leaves the engine awake."""
    awake = llm.memory_usage()
    report = llm.sleep(level)
    asleep = llm.memory_usage()
    if level >= 3:  # the context is checkpointed: no allocator to audit
        audit = type("NoAudit", (), dict(tagged_bytes=0, untagged_bytes=0, other_bytes=0))()
    else:
        audit = llm.memory.audit()  # what stays while asleep: the default pool, and outside any allocator
    start = time.perf_counter()
    result = llm.wake_up()
    if level in (2, 4):
        llm.reload_weights()
    wake_s = time.perf_counter() - start
    return dict(level=level, awake_mib=awake["device_used_bytes"] / MiB, asleep_mib=asleep["device_used_bytes"] / MiB,
                sleep_s=report.seconds, sleep_copied_mib=report.bytes_copied / MiB, wake_s=wake_s,
                wake_copied_mib=result.report.bytes_copied / MiB,
                asleep_tagged_mib=audit.tagged_bytes / MiB, asleep_untagged_pool_mib=audit.untagged_bytes / MiB,
                asleep_other_mib=(audit.other_bytes or 0) / MiB,
                tags={t: dict(awake_mib=u["resident_bytes"] / MiB, reserved_mib=u["reserved_bytes"] / MiB)
                      for t, u in awake["tags"].items()})


def level3_cycle(llm, level: int, name: str) -> dict:
    """One sleep at `level` and a full wake (+ reload after 2 and 4), wall seconds, with NVML's reading of
    this process's device memory (taken by the checkpoint helper) awake and asleep."""
    from torpor.memory import checkpoint

    awake = llm.memory_usage()
    awake_nvml = checkpoint.device_readings()
    start = time.perf_counter()
    report = llm.sleep(level)
    sleep_s = time.perf_counter() - start
    asleep = llm.memory_usage()
    asleep_nvml = checkpoint.device_readings()
    taken = checkpoint.current()  # the context's checkpoint (levels 3 and 4)
    start = time.perf_counter()
    llm.wake_up()
    if level in (2, 4):
        llm.reload_weights()
    wake_s = time.perf_counter() - start
    held = checkpoint.current()
    restored = checkpoint.last_restore() if taken is not None else None
    # What the driver took of the sleep and of the wake (the rest: the tags, the helper's pipe and NVML).
    driver = dict(checkpoint_s=taken.seconds if taken else 0.0, checkpoint=taken.driver_s if taken else {},
                  restore_s=restored.seconds if restored else 0.0, restore=restored.driver_s if restored else {})
    row = dict(name=name, level=level, sleep_s=sleep_s, wake_s=wake_s, driver=driver,
               copied_mib=(report.bytes_copied if report else 0) / MiB,
               awake_mib=awake["device_used_bytes"] / MiB, asleep_mib=asleep["device_used_bytes"] / MiB,
               process_awake_mib=awake_nvml.get("process_bytes", -MiB) / MiB,
               process_asleep_mib=asleep_nvml.get("process_bytes", -MiB) / MiB,
               context_released=asleep["context_released"], checkpoint_active_after_wake=held is not None)
    print(f"{name}: sleep {units.seconds(sleep_s)} (copied {units.size(row['copied_mib'] * MiB)}), wake "
          f"{units.seconds(wake_s)}; process "
          f"{row['process_awake_mib']:.0f} MiB awake, {row['process_asleep_mib']:.0f} MiB asleep (NVML); device in "
          f"use asleep {row['asleep_mib']:.0f} MiB" + (
              f"; of the sleep, the context's checkpoint {units.seconds(driver['checkpoint_s'])}, of the wake its "
              f"restore {units.seconds(driver['restore_s'])} (driver: " + ", ".join(
                  f"{k} {units.seconds(v)}" for k, v in {**driver['checkpoint'], **driver['restore']}.items()) + ")"
              if taken else ""), flush=True)
    return row


def start_up_with_and_without_reservation(model: str, args: argparse.Namespace, rounds: int = 2) -> dict:
    """Start-up to the first token in a new process, reserving the host copies and not, side by side: one
    warm-up start first (page cache, Triton's cache: the first start pays for them whichever option it
    has), then the two options alternated `rounds` times; the medians."""
    options = {"start_s_reserving": "", "start_s_not_reserving": ", reserve_host_copies=False"}
    cold_start_phases(model, args, options["start_s_not_reserving"])  # warm-up, not counted
    times: dict[str, list[float]] = {label: [] for label in options}
    for _ in range(rounds):
        for label, option in options.items():
            times[label].append(cold_start_phases(model, args, option)["total_s"])
    return {label: statistics.median(values) for label, values in times.items()}


def run_level3(args: argparse.Namespace, model: str, results: dict) -> int:
    """`--level3`: the figures of sleep to zero; see the module docstring."""
    from torpor.memory import checkpoint, cuda_driver
    from torpor.testing.harness import level3_scenarios, level3_soak_scenarios

    checkpoint.check_support(cuda_driver.pci_bus_id(torch.cuda.current_device()))  # clear error if unsupported
    results.update(start_up_with_and_without_reservation(model, args))
    print(f"start-up to first token in a new process: {results['start_s_reserving']:.2f} s reserving host copies, "
          f"{results['start_s_not_reserving']:.2f} s not", flush=True)
    llm, build_s = build(model, args)
    reservation = llm.engine.host_reservation
    reservation.wait()
    results["build_s"] = build_s
    results["reservation"] = dict(seconds=reservation.seconds, gib=reservation.reserved_bytes / 2**30,
                                  error=None if reservation.error is None else str(reservation.error))
    print(f"host copies reserved in the background: {reservation.reserved_bytes / 2**30:.2f} GiB in "
          f"{reservation.seconds:.2f} s (engine built in {build_s:.1f} s)", flush=True)
    rows = [level3_cycle(llm, 1, "level 1, first sleep (copies reserved)"),
            level3_cycle(llm, 1, "level 1, re-sleep (weights' copy kept)")]
    llm.engine.mark_weights_dirty()  # what update_weights / reload_weights / a push declare
    rows.append(level3_cycle(llm, 1, "level 1 after a weight write"))
    rows.append(level3_cycle(llm, 3, "level 3"))
    rows.append(level3_cycle(llm, 3, "level 3 (again)"))
    rows.append(level3_cycle(llm, 4, "level 4 (+ reload_weights)"))
    results["rows"] = rows
    exact = harness_and_soak(llm, args, results, level3_scenarios(), level3_soak_scenarios())
    report_level3(results)
    return finish(results, args, exact)


def run(args: argparse.Namespace) -> int:
    from torpor.cli.bench_memory import pinned_bandwidth

    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    args.device = device
    if device.startswith("cuda") and not torch.cuda.is_available():  # before a preset is written into the cache
        raise ValueError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    if args.level3 and not device.startswith("cuda"):
        raise ValueError("--level3 needs a CUDA device (level 3 releases the CUDA context)")
    model = resolve_model(args.model, device)
    if device.startswith("cuda"):
        torch.zeros(1, device=device)
    from torpor.memory import device_used_bytes

    bare = device_used_bytes(device)
    link = pinned_bandwidth(torch.device(device)) if device.startswith("cuda") else {}
    results: dict = dict(model=model, device=device, bare_mib=bare / MiB, link_gbps=link)
    if args.level3:
        return run_level3(args, model, results)
    if args.loader_only:
        return run_loader(model, args, results)
    if args.cold_start_only:
        return run_cold_starts(model, args, results)
    if args.soak_only:
        return run_soak(model, args, results)
    if not args.skip_untagged:
        llm, _ = build(model, args, untagged_phases=("runtime",))
        results["untagged_runtime"] = memory_figures(llm, device, 1)
        print(f"runtime untagged: asleep {results['untagged_runtime']['asleep_mib']:.0f} MiB", flush=True)
        del llm
        _release(device)
    llm, cold_s = build(model, args)
    results["cold_start_s"] = cold_s  # in this process: CUDA context, kernels and page cache warm
    results["cold_start_phases"] = cold_start_phases(model, args)
    results["cold_start_process_s"] = results["cold_start_phases"]["total_s"]
    print(f"cold start: {units.seconds(cold_s)} in this process, {units.seconds(results['cold_start_process_s'])} as a "
          "new process", flush=True)
    # The first level-1 sleep also pins the host buffers the later ones reuse.
    # level1_first: right after start-up, while the host copies may still be being reserved in the background
    # (the sleep takes the rest over); level1: a full copy, as after a weight update (the re-sleep that keeps a
    # clean copy is measured by --level3).
    for name, level in (("level1_first", 1), ("level1", 1), ("level2", 2)):
        llm.engine.mark_weights_dirty()
        results[name] = figures = memory_figures(llm, device, level)
        print(f"{name}: awake {figures['awake_mib']:.0f} MiB, asleep {figures['asleep_mib']:.0f} MiB "
              f"(bare {bare / MiB:.0f}), sleep {units.seconds(figures['sleep_s'])}, wake "
              f"{units.seconds(figures['wake_s'])}", flush=True)
    results["loader"] = loader_figures(llm, model, device)
    exact = harness_and_soak(llm, args, results)
    report(results)
    return finish(results, args, exact)


def harness_requests(llm, args: argparse.Namespace) -> list:
    """The bit-exact batch: `--requests` mixed requests whose prompt + 32 output tokens fit max_model_len."""
    from torpor.testing.harness import fixed_requests

    return fixed_requests(args.requests, llm.engine.vocab_size, max_prompt=min(256, args.max_model_len - 33),
                          max_tokens=32)


def run_soak(model: str, args: argparse.Namespace, results: dict) -> int:
    """`--soak-only`: the harness, then `--soak-cycles` cycles over every scenario, each compared exactly."""
    llm, results["cold_start_s"] = build(model, args)
    exact = harness_and_soak(llm, args, results)
    s = results["soak"]
    print(f"soak: {s['exact']}/{s['cycles']} cycles exact in {units.seconds(s['seconds'])}; device drift "
          f"{s['device_slope_mib']:+.4f} MiB/cycle, host RSS drift {s['host_rss_slope_mib']:+.4f} MiB/cycle (slope of "
          f"each scenario's readings, the largest); device {s['device_mib_first_last'][0]:.0f} -> "
          f"{s['device_mib_first_last'][1]:.0f} MiB, host RSS {s['host_rss_mib_first_last'][0]:.0f} -> "
          f"{s['host_rss_mib_first_last'][1]:.0f} MiB", flush=True)
    return finish(results, args, exact)


def harness_and_soak(llm, args: argparse.Namespace, results: dict, cases=None, soak_cases=None) -> bool:
    """The bit-exact harness over `cases` (default: every scenario), then `--soak-cycles` cycles over
    `soak_cases`; their figures into `results`. Returns whether every round was exact."""
    from torpor.testing.harness import run_harness, soak

    requests = harness_requests(llm, args)
    results["harness"] = [dict(name=s.name, mismatches=s.mismatches, sleep_s=s.sleep_s, wake_s=s.wake_s)
                          for s in run_harness(llm, requests, cases=cases)]
    start = time.perf_counter()
    soaked = soak(llm, requests[:16], args.soak_cycles, log=print, cases=soak_cases)
    results["soak"] = dict(cycles=soaked.cycles, exact=soaked.exact_cycles, seconds=time.perf_counter() - start,
                           device_slope_mib=soaked.drift(soaked.device_bytes),
                           host_rss_slope_mib=soaked.drift(soaked.host_rss_bytes),
                           device_mib_first_last=[soaked.device_bytes[0] / MiB, soaked.device_bytes[-1] / MiB],
                           host_rss_mib_first_last=[soaked.host_rss_bytes[0] / MiB, soaked.host_rss_bytes[-1] / MiB])
    return all(h["mismatches"] == 0 for h in results["harness"]) and soaked.exact_cycles == soaked.cycles


def finish(results: dict, args: argparse.Namespace, exact: bool) -> int:
    """Write the JSON (when asked for); the exit code: 0 when every round was exact."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if exact else 1


def run_loader(model: str, args: argparse.Namespace, results: dict) -> int:
    """`--loader-only`: the weight rows, and the answers before and after every reload compared."""
    from torpor.engine import SamplingParams
    from torpor.testing.harness import differences, fixed_requests, run_round

    llm, results["cold_start_s"] = build(model, args)
    requests = fixed_requests(8, llm.engine.vocab_size, max_prompt=64, max_tokens=16)
    requests = [(p, SamplingParams(temperature=0.0, max_tokens=sp.max_tokens, ignore_eos=True)) for p, sp in requests]
    before = run_round(llm, requests)
    results["loader"] = loader_figures(llm, model, args.device)
    results["loader"]["answers_unchanged"] = not differences(before, run_round(llm, requests))
    cold_starts(model, args, results)
    report_loader(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if results["loader"]["answers_unchanged"] else 1


def cold_starts(model: str, args: argparse.Namespace, results: dict) -> None:
    """A restart profiling its KV-sizing step (the old path: weights loaded first, every graph size warmed up);
    then restarts reading back the step it measured: the old path (TORPOR_OVERLAP_LOAD=0,
    TORPOR_CAPTURE_WARMUPS=every), the weights loaded beside the KV sizing and the graph capture with every size
    warmed up, and the default (beside, one warm-up), alternated `--cold-start-rounds` times each
    (`cold_start_alternated`: the machine's noise moves them alike; the rows named as before are the first of
    each); the default under cProfile (where the start-up's own time goes); loaded first with one warm-up; the old
    path and the default again with the checkpoint's page cache dropped first."""
    results["cold_start_phases_profiling"] = cold_start_phases(model, args, kv_profile_cache=False, overlap_load=False,
                                                               capture_warmups="every")
    alternated: dict[str, list[dict]] = {"loaded_first": [], "overlapped": [], "overlapped_one_warmup": []}
    for _ in range(max(1, args.cold_start_rounds)):
        alternated["loaded_first"].append(cold_start_phases(model, args, overlap_load=False, capture_warmups="every"))
        alternated["overlapped"].append(cold_start_phases(model, args, overlap_load=True, capture_warmups="every"))
        alternated["overlapped_one_warmup"].append(cold_start_phases(model, args))
    results["cold_start_alternated"] = alternated
    results["cold_start_phases"] = alternated["loaded_first"][0]
    results["cold_start_phases_overlapped"] = alternated["overlapped"][0]
    results["cold_start_phases_default"] = alternated["overlapped_one_warmup"][0]
    results["cold_start_phases_profiled"] = cold_start_phases(model, args, profile_top=30)
    results["cold_start_phases_one_warmup"] = cold_start_phases(model, args, overlap_load=False)
    results["cold_start_phases_cold_cache"] = cold_start_phases(model, args, overlap_load=False, cold_cache=True,
                                                                capture_warmups="every")
    results["cold_start_phases_cold_cache_overlapped"] = cold_start_phases(model, args, cold_cache=True)


def run_cold_starts(model: str, args: argparse.Namespace, results: dict) -> int:
    """`--cold-start-only`: the cold starts of `cold_starts`, reported as in `--loader-only`, after one start
    not counted that leaves what a restart finds (the KV-sizing step's memory, Triton's kernels, the bytecode)."""
    cold_start_phases(model, args)
    cold_starts(model, args, results)
    report_loader(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
