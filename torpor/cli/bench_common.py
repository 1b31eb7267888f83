"""What the `torpor bench` subcommands share: the device and model a run uses, its goals, units, tables,
progress lines and JSON; the checkpoint's files and the page cache; bandwidths measured in the same run; the
device's busy time from torch's profiler; and a cold start in a new process (`torpor.cli.cold_start`).

Every bench uses torpor's public surface only (`torpor.LLM`, `torpor.memory`, `torpor.testing`, `torpor.rl`,
`torpor.synthetic`, `torpor serve`'s HTTP API): its figures mean what a user of those gets.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

GB, GiB, MiB = 1e9, 2**30, 2**20
# The goals of docs/*.md are for these models on this GPU; other runs show no goal.
GOAL_GPU = "H200"
# Start-up phases that are not part of the main thread's sequence (`LLM.startup_phases`): the load's own
# thread beside it, the graph warm-up inside the capture, and the sum.
BESIDE_PHASES = {"weight_load_beside": "on its own thread, beside the others",
                 "cuda_graph_warm_up": "inside cuda_graph_capture"}
_T0 = time.perf_counter()


# ---- the run: device, model, goals ------------------------------------------------------------------------
def resolve_device(name: str) -> str:
    """'auto' -> 'cuda' when available, else 'cpu'; a CUDA device without CUDA is a clear error (before a
    preset is written into the cache)."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if name in ("auto", None) else name
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"--device takes auto, cpu, cuda or cuda:N, got {device!r}")
    return device


def resolve_model(name: str | None, device: str, gpu_default: str = "qwen3-8b",
                  cache_dir: str | None = None) -> tuple[str, str]:
    """(checkpoint folder, label): a preset name is generated once into the cache (`torpor.synthetic`); None is
    `gpu_default` on a GPU and the tiny model on CPU; anything else is a folder."""
    from torpor.synthetic import PRESETS, cached_model_path

    name = name or (gpu_default if device.startswith("cuda") else "tiny")
    if name in PRESETS:
        return str(cached_model_path(name, progress=True, models_dir=cache_dir)), name
    path = Path(name)
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {name}: neither a preset ({', '.join(PRESETS)}) nor a checkpoint folder "
                         "with a config.json")
    return str(path), path.name


class Run:
    """Where a bench runs and which goals apply: a goal is shown only on the GPU and model it is for."""

    def __init__(self, device: str, model_label: str) -> None:
        self.device, self.model = device, model_label
        self.on_cuda = device.startswith("cuda")
        self.gpu = torch.cuda.get_device_name(torch.device(device)) if self.on_cuda else "cpu"

    def goal(self, text: str, models: tuple[str, ...] = ("qwen3-8b",), model: str | None = None) -> str:
        """'goal TEXT' where this run (or its `model`, for a bench of several) is one the goal is for, else ''."""
        mine = model or self.model
        return f"goal {text}" if self.on_cuda and GOAL_GPU in self.gpu and mine in models else ""

    def goal_note(self, models: tuple[str, ...] = ("qwen3-8b",), ran: tuple[str, ...] | None = None) -> str:
        """Why no goal is shown, where none is: '' when the run (or one of the models it `ran`) has goals."""
        if not self.on_cuda:
            return "CPU smoke run: no goal"
        if GOAL_GPU not in self.gpu or not set(ran or (self.model,)) & set(models):
            return f"the goals are for {' / '.join(models)} on an {GOAL_GPU}: none shown"
        return ""

    def header(self, models: tuple[str, ...] = ("qwen3-8b",)) -> str:
        return "; ".join(filter(None, (f"{self.model} on {self.gpu}", self.goal_note(models))))

    def describe(self) -> dict:
        return {"device": self.device, "gpu": self.gpu, **({"model": self.model} if self.model else {}),
                "torch": torch.__version__}


def vocab_size(model_path: str) -> int:
    """The checkpoint's vocabulary size (its config.json, Hugging Face's layout)."""
    return int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])


# ---- the checkpoint's files -------------------------------------------------------------------------------
def checkpoint_files(model_path: str) -> list[Path]:
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_path}: no .safetensors files")
    return files


def tensor_bytes(model_path: str) -> dict[str, int]:
    """Bytes of every tensor of the checkpoint, by name, from the safetensors headers (no data read)."""
    sizes = {}
    for file in checkpoint_files(model_path):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        sizes.update({name: end - start for name, entry in header.items() if name != "__metadata__"
                      for start, end in [entry["data_offsets"]]})
    return sizes


def load_tensors(model_path: str, device: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint on `device` (what a trainer holds), in file order."""
    from safetensors.torch import load_file

    return [(name, tensor.to(device)) for file in checkpoint_files(model_path)
            for name, tensor in load_file(file).items()]


def warm_page_cache(files) -> None:
    """Read every file once ("page cache warm")."""
    for file in files:
        with open(file, "rb") as f:
            while f.read(64 << 20):
                pass


def drop_page_cache(files) -> None:
    """Ask the kernel to drop the files' cached pages ("page cache cold"; no effect on tmpfs)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ---- the device -------------------------------------------------------------------------------------------
def sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def release(device: str | torch.device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def pinned_bandwidth(device: str, nbytes: int = 4 * GiB, repeats: int = 3) -> dict[str, float]:
    """GB/s of plain torch copies between one device buffer and one pinned host buffer ("d2h", "h2d"): the
    host link a sleep and a wake are measured against."""
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
        result[name] = repeats * nbytes / (time.perf_counter() - start) / GB
    del d, h
    release(device)
    return result


def copy_bandwidth(device: str, nbytes: int, repeats: int = 10) -> float:
    """GB/s of bytes read + written by `dst.copy_(src)` on the device: what its memory sustains for a
    streaming kernel (the roofline of a decode step)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync(device)
    seconds = time.perf_counter() - start
    del src, dst
    release(device)
    return 2 * nbytes * repeats / seconds / GB


def profiled(fn, device: str):
    """`fn()` under torch's profiler: (its result, seconds the device was busy: the union of the intervals of
    its kernels and copies; None off CUDA), and the profile (for `top_kernels`)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    sync(device)
    with warnings.catch_warnings():  # "Profiler clears events at the end of each cycle": one cycle here
        warnings.simplefilter("ignore", UserWarning)
        with profile(activities=activities) as prof:
            result = fn()
            sync(device)
    if not on_cuda:
        return result, None, prof
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return result, busy / 1e6, prof


def top_kernels(prof, on_cuda: bool, top: int = 20) -> list[dict]:
    """The `top` kernels and copies (on CPU: operators) by their own time: name, seconds, calls."""
    from torch.autograd import DeviceType

    def own_us(event) -> float:
        if not on_cuda:
            return event.self_cpu_time_total
        if event.device_type != DeviceType.CUDA:  # an operator: its kernels are counted as themselves
            return 0.0
        return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)

    events = sorted((e for e in prof.key_averages() if own_us(e) > 0), key=own_us, reverse=True)[:top]
    return [{"name": e.key[:90], "s": own_us(e) / 1e6, "calls": e.count} for e in events]


# ---- cold starts ------------------------------------------------------------------------------------------
def cold_start(model: str, device: str, options: dict, drop_cache: bool = False, timeout: float = 600) -> dict:
    """A new Python process to its first generated token (`python -m torpor.cli.cold_start`), with
    `LLM(model, device, **options)`: what a restart costs instead of a wake. Returns its seconds in all (from
    the launch to the first token; its exit is not start-up), `imports_s`, `startup_phases` (the LLM's), the
    start-up's seconds outside every phase (`engine_other_s`) and `first_token_s`. `drop_cache`: the
    checkpoint's pages dropped from the page cache first."""
    if drop_cache:
        drop_page_cache(checkpoint_files(model))
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    command = [sys.executable, "-m", "torpor.cli.cold_start", model, "--device", device,
               "--options", json.dumps(options)]
    launched = time.time()
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the cold-start process did not reach its first token within {timeout:.0f} s") from None
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"the cold-start process failed (exit {out.returncode}): {out.stderr[-2000:]}")
    child = json.loads(lines[-1])
    phases = child["startup_phases"]
    in_sequence = sum(v for k, v in phases.items() if k not in BESIDE_PHASES and k != "total")
    return {"total_s": child["ready_at"] - launched, "imports_s": child["imports_s"], "startup_phases": phases,
            "engine_other_s": phases["total"] - in_sequence, "first_token_s": child["first_token_s"],
            "options": options, "page_cache": "cold" if drop_cache else "warm"}


def median_run(runs: list[dict], key: str = "total_s") -> dict:
    """The run whose `key` is the median (the lower one of an even count), with every run's figure."""
    ordered = sorted(runs, key=lambda r: r[key])
    return {**ordered[(len(ordered) - 1) // 2], "runs_s": [r[key] for r in runs]}


# ---- output -----------------------------------------------------------------------------------------------
def fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    magnitude = abs(seconds)
    if magnitude >= 1:
        return f"{seconds:.2f} s"
    if magnitude >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.1f} µs"


def fmt_bytes(nbytes: float | None, signed: bool = False) -> str:
    if nbytes is None:
        return "-"
    sign = "+" if signed and nbytes >= 0 else ""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(nbytes) >= size:
            return f"{sign}{nbytes / size:.2f} {unit}" if unit == "GiB" else f"{sign}{nbytes / size:.1f} {unit}"
    return f"{sign}{nbytes:.0f} B"


def fmt_rate(bytes_per_s: float | None) -> str:
    if bytes_per_s is None or bytes_per_s <= 0:
        return "-"
    for unit, size in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= size:
            return f"{bytes_per_s / size:.1f} {unit}"
    return f"{bytes_per_s:.0f} B/s"


def fmt_pct(part: float | None, whole: float | None) -> str:
    """'93%'; blank where either is unknown (a column of blanks is left out of a table)."""
    return f"{100 * part / whole:.0f}%" if part and whole else ""


def console():
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=160)


def table(title: str, columns: list[str], rows: list[list[str]], caption: str | None = None):
    """A rich table: the first column left-aligned (labels), the others right-aligned (figures); a column whose
    every cell is blank (a goal column on CPU, a share of a link not measured) is left out."""
    from rich.table import Table

    keep = [i for i in range(len(columns)) if i == 0 or any(row[i] for row in rows)]  # no column of blanks
    t = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    for i in keep:
        t.add_column(columns[i], justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*(row[i] for i in keep))
    return t


def progress(message: str) -> None:
    """A progress line on stderr (the tables go to stdout), with the seconds since the bench started."""
    print(f"[{time.perf_counter() - _T0:7.1f} s] {message}", file=sys.stderr, flush=True)


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="also write every figure here (seconds, bytes, GB/s; e.g. benchmarks/results/)")


def check_json_path(path: str | None) -> None:
    """Fail before the work when the JSON cannot be written, not after it."""
    if path is not None:
        parent = Path(path).resolve().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise OSError(f"--json {path}: the folder {parent} does not exist or cannot be written")


def write_json(path: str | None, results: dict) -> None:
    if path is not None:
        Path(path).write_text(json.dumps(results, indent=1, default=str) + "\n")


def median(values) -> float:
    return statistics.median(values)
