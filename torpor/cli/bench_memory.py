"""`torpor bench memory`: sleep/wake throughput and residual memory, side by side with the
host link's measured bandwidth and (when installed) torch_memory_saver.

Workloads: one large tensor, and many small ones of the same total. Each runs `--cycles`
offload/restore cycles; the first cycle includes pinning the host buffers, later ones reuse them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from torpor.cli import units
from torpor.memory import device_used_bytes

GiB = 2**30
MiB = 2**20


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("memory", help="sleep/wake throughput of torpor.memory",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--size", type=float, default=None,
                   help="GiB per workload (default: 8 on GPU, 0.5 on CPU)")
    p.add_argument("--num-small", type=int, default=512, help="tensors in the many-small workload")
    p.add_argument("--cycles", type=int, default=3, help="sleep/wake cycles per workload")
    p.add_argument("--no-compare", action="store_true", help="skip torch_memory_saver even if installed")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--tms-worker", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_bandwidth(device: torch.device, nbytes: int = 4 * GiB, repeats: int = 3) -> dict[str, float]:
    """Plain torch copies between one device buffer and one pinned host buffer, GB/s."""
    d = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    result = {}
    for name, (dst, src) in {"d2h": (h, d), "h2d": (d, h)}.items():
        dst.copy_(src, non_blocking=True)
        sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        sync(device)
        result[name] = repeats * nbytes / (time.perf_counter() - start) / 1e9
    del d, h
    torch.cuda.empty_cache()
    return result


def make_tensors(device: torch.device, total: int, count: int) -> list[torch.Tensor]:
    """`count` uint8 tensors of `total` bytes together, filled with random bytes."""
    each = total // count // 64 * 64  # whole int64 words, for `checksum`
    gen = torch.Generator(device=device).manual_seed(0)
    # random_ in place: torch.randint would materialize an int64 tensor 8x the size first
    return [torch.empty(each, dtype=torch.uint8, device=device).random_(0, 256, generator=gen)
            for _ in range(count)]


def checksum(tensors: list[torch.Tensor]) -> int:
    """Wrapping int64 sum of the bytes read 8 at a time: no scratch the size of the data."""
    return int(sum(t.view(torch.int64).sum() for t in tensors))


def measure_cycles(engine: str, device: torch.device, tensors: list[torch.Tensor], cycles: int, bare: int,
                   sleep, wake) -> list[dict]:
    """`cycles` rounds of sleep() then wake(), each returning (seconds, GB/s); memory read around them
    and the data checked after every wake."""
    total, reference = sum(t.numel() for t in tensors), checksum(tensors)
    rows = []
    for cycle in range(cycles):
        sync(device)
        awake = device_used_bytes(device)
        sleep_s, offload_gbps = sleep()
        asleep = device_used_bytes(device)
        wake_s, restore_gbps = wake()
        rows.append(dict(engine=engine, workload=f"{len(tensors)} x {total // len(tensors) // MiB} MiB",
                         cycle=cycle + 1, offload_gbps=offload_gbps, restore_gbps=restore_gbps, sleep_s=sleep_s,
                         wake_s=wake_s, awake_mib=awake / MiB, asleep_mib=asleep / MiB,
                         after_mib=device_used_bytes(device) / MiB, asleep_over_bare_mib=(asleep - bare) / MiB,
                         identical=checksum(tensors) == reference))
    return rows


def bench_torpor(device: torch.device, total: int, count: int, cycles: int, bare: int) -> list[dict]:
    from torpor.memory import MemoryManager

    mm = MemoryManager(device)
    with mm.tag("bench"):
        tensors = make_tensors(device, total, count)

    def sleep() -> tuple[float, float]:
        report = mm.sleep({"bench": "offload"})
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the checksums' scratch in the default pool is not the workload
        return report.seconds, report.copy_gbps

    def wake() -> tuple[float, float]:
        report = mm.wake()
        return report.seconds, report.copy_gbps

    rows = measure_cycles("torpor", device, tensors, cycles, bare, sleep, wake)
    del tensors
    mm.close()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def bench_tms(tms, device: torch.device, total: int, count: int, cycles: int, bare: int) -> list[dict]:
    """The same workload through torch_memory_saver with CPU backup (run in a child process)."""
    with tms.region(tag="bench", enable_cpu_backup=True):
        tensors = make_tensors(device, total, count)

    def timed(call) -> tuple[float, float]:
        start = time.perf_counter()
        call("bench")
        sync(device)
        seconds = time.perf_counter() - start
        return seconds, total / seconds / 1e9

    rows = measure_cycles("torch_memory_saver", device, tensors, cycles, bare,
                          lambda: timed(tms.pause), lambda: timed(tms.resume))
    _KEEP.append(tensors)  # freeing region memory aborts torch_memory_saver 0.0.10 in torch hook mode
    return rows


_KEEP: list = []


def tms_worker(device: torch.device, args: argparse.Namespace) -> list[dict]:
    from torch_memory_saver import TorchMemorySaver

    tms = TorchMemorySaver()
    tms.hook_mode = "torch"  # the pluggable-allocator mode, as torpor (no LD_PRELOAD)
    torch.zeros(1, device=device)
    bare = device_used_bytes(device)
    return [r for total, count in workloads(args) for r in bench_tms(tms, device, total, count, args.cycles, bare)]


def compare_tms(args: argparse.Namespace) -> list[dict]:
    try:
        import torch_memory_saver  # noqa: F401
    except ImportError:
        print("torch_memory_saver is not installed: no side-by-side comparison")
        return []
    cmd = [sys.executable, "-m", "torpor.cli.main", "bench", "memory", "--tms-worker", "--device", args.device,
           "--size", str(args.size), "--num-small", str(args.num_small), "--cycles", str(args.cycles)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("["):
        print(f"torch_memory_saver run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        return []
    if proc.returncode != 0:
        print(f"torch_memory_saver's process exited with {proc.returncode} after reporting: {proc.stderr[-300:]}")
    return json.loads(lines[-1])


def workloads(args: argparse.Namespace) -> list[tuple[int, int]]:
    total = int(args.size * GiB)
    return [(total, 1), (total, args.num_small)]


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.device = str(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: CUDA is not available on this machine; use --device cpu")
    args.size = args.size if args.size is not None else (8.0 if device.type == "cuda" else 0.5)
    if args.tms_worker:
        print(json.dumps(tms_worker(device, args)))
        return 0
    if device.type == "cuda":
        torch.zeros(1, device=device)
        sync(device)
    bare = device_used_bytes(device)
    link = pinned_bandwidth(device) if device.type == "cuda" else {}
    rows = []
    for total, count in workloads(args):
        print(f"torpor: {count} tensor(s), {units.size(total)}, {args.cycles} cycles ...", flush=True)
        rows += bench_torpor(device, total, count, args.cycles, bare)
    if device.type == "cuda" and not args.no_compare:
        print("torch_memory_saver: same workloads in a child process ...", flush=True)
        rows += compare_tms(args)
    report(device, bare, link, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(device), env=environment(device), bare_mib=bare / MiB, link_gbps=link,
                           rows=rows), f, indent=1)
    return 0 if all(r["identical"] for r in rows) else 1


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        try:
            import cuda.bindings

            env["cuda_bindings"] = cuda.bindings.__version__
        except (ImportError, AttributeError):
            pass
    return env


def report(device: torch.device, bare: int, link: dict, rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200) if not sys.stdout.isatty() else Console()
    versions = ", ".join(f"{k} {v}" for k, v in environment(device).items())
    console.print(f"device {device} ({versions}); bare context {bare / MiB:.0f} MiB in use")
    if link:
        console.print(f"pinned copy bandwidth: d2h {units.rate(link['d2h'] * 1e9, 1)}, h2d "
                      f"{units.rate(link['h2d'] * 1e9, 1)}")
    table = Table(title="sleep (offload) and wake (restore)")
    for col in ("engine", "workload", "cycle", "offload", "% link", "restore", "% link",
                "awake MiB", "asleep MiB", "asleep-bare", "identical"):
        table.add_column(col, justify="right")
    def pct(value: float, key: str) -> str:
        return f"{100 * value / link[key]:.0f}%" if link else "-"

    for r in rows:
        table.add_row(r["engine"], r["workload"], str(r["cycle"]), units.rate(r["offload_gbps"] * 1e9, 1) or "-",
                      pct(r["offload_gbps"], "d2h"), units.rate(r["restore_gbps"] * 1e9, 1) or "-",
                      pct(r["restore_gbps"], "h2d"),
                      f"{r['awake_mib']:.0f}", f"{r['asleep_mib']:.0f}", f"{r['asleep_over_bare_mib']:+.0f}",
                      "yes" if r["identical"] else "NO")
    console.print(table)
    for workload in dict.fromkeys(r["workload"] for r in rows):
        ours = [r for r in rows if r["engine"] == "torpor" and r["workload"] == workload and r["cycle"] > 1]
        theirs = [r for r in rows if r["engine"] != "torpor" and r["workload"] == workload and r["cycle"] > 1]
        if ours and theirs:
            def mean(rs: list[dict], key: str) -> float:
                return sum(r[key] for r in rs) / len(rs)

            console.print(f"{workload}: vs torch_memory_saver (mean of cycles >= 2): pause "
                          f"{mean(ours, 'offload_gbps') / mean(theirs, 'offload_gbps'):.1f}x faster, resume "
                          f"{mean(ours, 'restore_gbps') / mean(theirs, 'restore_gbps'):.1f}x faster")
