"""`torpor demo`: the engine sleeps, wakes, and answers bit-identically.

Starts the engine -- on a GPU with the qwen3-0.6b geometry (synthetic weights, generated once into
the cache), on CPU with the embedded tiny model, or on --model -- answers a fixed batch of requests
(greedy and seeded sampling, with logprobs), then runs three sleep/wake cycles -- level 1 with a
full wake, level 1 with a selective wake (weights, then KV cache), level 2 with the weights
reloaded -- and after each checks that every answer is bit-identical to the first. Prints, per
cycle, the bytes in the tags' tensors and the device memory in use (RSS on CPU) awake / asleep /
woken, and the sleep and wake times (--wide: every tag, the host copies, the bytes copied and the
rates), and writes a plot of memory over the timeline (into the cache folder unless --plot says
where).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from torpor.cli import units

MiB, GiB = 2**20, 2**30
WIDE_COLUMNS = 160  # --wide into a pipe
GPU_PRESET = "qwen3-0.6b"  # a real geometry: GiB to move, so the table shows link speed
PLOT_FORMATS = (".png", ".pdf", ".svg")
CYCLES = {  # name: (level, the tags of each wake_up call, reload the weights after the first)
    "sleep(1), wake all": (1, [None], False),
    "sleep(1), weights, kv_cache": (1, [["weights"], ["kv_cache"]], False),
    "sleep(2), weights, reload, kv_cache": (2, [["weights"], ["kv_cache"]], True),
}
PROMPTS = ["The engine fell asleep", "Memory comes back", "Every byte returns", "A quiet GPU",
           "Wake up and answer", "Offload, discard, keep", "Graphs stay valid", "Bit for bit"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="sleep and wake the engine and check every answer (the main job)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help=f"checkpoint folder (default: on a GPU the {GPU_PRESET} geometry with synthetic weights, "
                        "generated once into the cache; on CPU the embedded tiny model)")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda or cuda:N")
    p.add_argument("--plot", default=None,
                   help="where to write the memory plot: .png, .pdf or .svg ('' = none; default: "
                        "torpor-demo-memory.png in the cache folder, ~/.cache/torpor or $TORPOR_CACHE)")
    p.add_argument("--wide", action="store_true",
                   help="the full table: every tag, the host copies, the bytes each copy moved and its rate")
    p.set_defaults(func=run)


class Timeline:
    """Device memory, host copies and per-tag bytes at each event of the demo."""

    def __init__(self, llm) -> None:
        self.llm, self.start, self.rows = llm, time.perf_counter(), []

    def mark(self, event: str) -> dict:
        usage = self.llm.memory_usage()
        # live: bytes in the tag's tensors while they are on the device (0 while the tag sleeps); resident:
        # the device memory its segments hold (on CPU whole 16 MiB chunks, even for a few live bytes)
        live = {tag: u["allocated_bytes"] if u["resident_bytes"] else 0 for tag, u in usage["tags"].items()}
        row = dict(t=time.perf_counter() - self.start, event=event, device=usage["device_used_bytes"],
                   host=usage["host_backup_bytes"], live=live,
                   tags={tag: u["resident_bytes"] for tag, u in usage["tags"].items()})
        self.rows.append(row)
        return row

    def plot(self, path: Path, device: str) -> None:
        """Per-tag resident bytes as stacked bars, one per event (centred on its tick), and the memory in
        use as a line over them; one legend, above the plot, so nothing hides the data."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(11, 5.5))
        steps = list(range(len(self.rows)))
        bottom = [0.0] * len(steps)
        for tag in self.rows[0]["tags"]:
            heights = [r["tags"].get(tag, 0) / MiB for r in self.rows]
            ax.bar(steps, heights, width=0.7, bottom=bottom, label=f"tag {tag}", alpha=0.85)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.set_ylabel("tag memory resident, MiB (stacked)")
        ax.set_ylim(0, max(max(bottom), 1e-3) * 1.15)
        used = ax.twinx()
        in_use = [r["device"] / MiB for r in self.rows]
        used.plot(steps, in_use, color="black", linewidth=2, marker="o",
                  label="process RSS" if device == "cpu" else "device memory in use")
        used.set_ylabel("MiB in use")
        used.set_ylim(0, max(in_use) * 1.15)  # headroom: the line never runs along the frame
        ax.set_xticks(steps, [r["event"] for r in self.rows], rotation=40, ha="right", fontsize=7)
        ax.set_xlim(-0.6, len(steps) - 0.4)
        handles = [h for a in (ax, used) for h in a.get_legend_handles_labels()[0]]
        fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
        ax.set_title(f"torpor demo on {device}: memory at each step of the timeline", pad=4)
        fig.tight_layout(rect=(0, 0, 1, 0.92))  # the top strip holds the legend
        fig.savefig(path, dpi=110)
        plt.close(fig)


def requests(llm):
    from torpor.engine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=12, logprobs=2, ignore_eos=True)
              for i in range(len(PROMPTS))]
    return PROMPTS, params


def cycle(llm, level: int, wakes: list, reload: bool, timeline: Timeline) -> dict:
    before = timeline.mark("awake")
    slept = llm.sleep(level)
    asleep = timeline.mark(f"sleep({level})")
    wake_s, wake_bytes = 0.0, 0
    for i, tags in enumerate(wakes):
        result = llm.wake_up(tags)
        wake_s += result.report.seconds
        wake_bytes += result.report.bytes_copied
        timeline.mark(f"wake_up({tags or 'all'})")
        if reload and i == 0:
            start = time.perf_counter()
            llm.reload_weights()
            wake_s += time.perf_counter() - start
            timeline.mark("reload_weights")
    after = timeline.mark("awake again")
    return dict(before=before, asleep=asleep, after=after, sleep_s=slept.seconds, sleep_bytes=slept.bytes_copied,
                wake_s=wake_s, wake_bytes=wake_bytes)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from torpor.engine import LLM
    from torpor.testing.harness import differences

    plot = plot_path(default_plot() if args.plot is None else args.plot) if args.plot != "" else None  # checked now
    on_gpu = uses_gpu(args.device)
    # A pipe gets the terminal's default width (80, or $COLUMNS); --wide asks for room.
    console = Console(width=WIDE_COLUMNS) if args.wide and not sys.stdout.isatty() else Console()
    model, synthetic = args.model, args.model is None
    if model is None and on_gpu:
        from torpor.synthetic import cached_model_path

        console.print(f"the {GPU_PRESET} geometry (synthetic weights) is generated once into the cache")
        model = str(cached_model_path(GPU_PRESET, progress=True))
    elif model is not None and not Path(model).is_dir():
        from torpor.cli.make_model import preset_hint

        raise ValueError(f"--model {model}: no such checkpoint folder{preset_hint(model, 'demo --model')}")
    what = "the model" if model else "the tiny model (generated on the first run)"
    with console.status(f"preparing {what} and starting the engine"):
        # A fixed KV cache for the demo's batch: the table then shows what each tag holds, not a profile.
        llm = LLM(model, device=args.device, max_num_seqs=16, max_model_len=512,
                  **({"num_kv_blocks": 16 * 512 // 16} if on_gpu else {}))
    device = str(llm.config.device)
    console.print(f"engine on {device}: {llm.config.model}")
    if synthetic:
        console.print("the weights are synthetic (seeded random numbers, no training): the answers are "
                      "gibberish by design; what counts is that every wake gives them back bit for bit")
    if on_gpu:  # pin the host copies now: the table then shows the link's speed from the first sleep
        start = time.perf_counter()
        offloaded = [t for t in ("weights", "runtime", "cuda_graph") if t in llm.memory_usage()["tags"]]
        pinned = llm.memory.reserve_host(offloaded)
        console.print(f"host copies reserved ahead of the first sleep: {units.size(pinned)} pinned in "
                      f"{units.seconds(time.perf_counter() - start)}")
    prompts, params = requests(llm)
    timeline = Timeline(llm)
    reference = llm.generate(prompts, params, use_tqdm=False)
    console.print(f"first answer: {prompts[0]!r} -> {reference[0].outputs[0].text!r}")
    results, ok = [], True
    for name, (level, wakes, reload) in CYCLES.items():
        r = cycle(llm, level, wakes, reload, timeline)
        r.update(name=name, same=not differences(reference, llm.generate(prompts, params, use_tqdm=False)))
        ok &= r["same"]
        results.append(r)
    timeline.mark("end")
    for printed in wide_tables(results, device) if args.wide else [table(results, device)]:
        console.print(printed)
    if device == "cpu":
        console.print(f"On CPU the memory in use is the process's RSS: it holds the host copies "
                      f"({units.size(results[0]['asleep']['host'])}) while the engine sleeps, and a woken tag's "
                      "zero-filled pages count only once written.", style="dim")
    if plot is not None:
        timeline.plot(plot, device)
        console.print(f"memory plot written to {plot}")
    console.print("every answer bit-identical to the first" if ok else "[red]answers differ after a wake[/red]")
    return 0 if ok else 1


def table(results: list[dict], device: str):
    """One row per cycle, narrow enough for 80 columns: the bytes in the tags' live tensors and the memory in
    use, awake -> asleep -> woken, in one unit; the sleep and wake times; the answers."""
    readings = [lambda row: sum(row["live"].values()), lambda row: row["device"]]
    unit = units.size_unit(max(reading(r[k]) for r in results for k in ("before", "after") for reading in readings))
    name = units.size(0, unit).split()[1]
    out = _table(f"torpor demo on {device}: {name} awake → asleep → woken")
    out.add_column("cycle", min_width=18)
    for header, reading in zip(("tensors", "RSS" if device == "cpu" else "in use"), readings, strict=True):
        _memory_column(out, results, header, reading, unit)
    for header in ("sleep", "wake"):
        out.add_column(header, justify="right", no_wrap=True)
    out.add_column("answers", no_wrap=True)
    for r in results:
        out.add_row(r["name"], *r.pop("cells"), units.seconds(r["sleep_s"]), units.seconds(r["wake_s"]),
                    "same" if r["same"] else "[red]DIFFER")
    return out


def wide_tables(results: list[dict], device: str) -> list:
    """--wide: the live bytes of every tag, the host copies and the memory in use; then each copy's time,
    bytes and rate."""
    memory = _table(f"torpor demo on {device}: bytes in live tensors on the device, awake → asleep → woken")
    memory.add_column("cycle", no_wrap=True)
    for tag in results[0]["before"]["live"]:
        _memory_column(memory, results, tag, lambda row, tag=tag: row["live"][tag])
    _memory_column(memory, results, "host copies", lambda row: row["host"])
    _memory_column(memory, results, "in use" + (" (RSS)" if device == "cpu" else ""), lambda row: row["device"])
    for r in results:
        memory.add_row(r["name"], *r.pop("cells"))
    copies = _table("sleep and wake: time, bytes copied, rate (the level-2 wake includes reload_weights)")
    copies.add_column("cycle", no_wrap=True)
    for name in ("sleep", "wake", "answers"):
        copies.add_column(name, no_wrap=True)
    for r in results:
        copies.add_row(r["name"], _copy(r["sleep_s"], r["sleep_bytes"]), _copy(r["wake_s"], r["wake_bytes"]),
                       "bit-identical" if r["same"] else "[red]DIFFERENT")
    return [memory, copies]


def _table(title: str):
    from rich import box
    from rich.table import Table

    return Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, padding=0)


def _memory_column(table, results: list[dict], name: str, value, unit: int | None = None) -> None:
    """A column of awake → asleep → woken readings in one unit (`unit`, else the largest reading's, named in
    the header); each row's cell is appended to the row's "cells"."""
    readings = [[value(r[k]) for k in ("before", "asleep", "after")] for r in results]
    if unit is None:
        unit = units.size_unit(max(max(row) for row in readings))
        name = f"{name}, {units.size(0, unit).split()[1]}"
    table.add_column(name, justify="right", no_wrap=True)
    for r, row in zip(results, readings, strict=True):
        r.setdefault("cells", []).append(" → ".join(units.number(v / unit) for v in row))


def _copy(seconds: float, nbytes: int) -> str:
    """Time, and for copies the bytes moved and the rate (decimal GB/s, as links are quoted)."""
    rate = units.rate(nbytes, seconds)
    return units.seconds(seconds) + ("" if rate is None else f", {units.size(nbytes)}, {rate}")


def default_plot() -> str:
    """The plot's default place: the cache folder (a checkout or the current folder stays clean)."""
    from torpor.env import Env

    folder = Path(Env.read().cache_dir)
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder / "torpor-demo-memory.png")


def uses_gpu(device: str) -> bool:
    """Whether `--device` means CUDA; a CUDA device on a machine without one is refused here."""
    import torch

    if device == "auto":
        return torch.cuda.is_available()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    return device.startswith("cuda")


def plot_path(path: str) -> Path:
    """The plot's absolute path, checked before the demo runs: a format matplotlib writes, an existing
    writable folder, and matplotlib installed."""
    target = Path(path).expanduser().absolute()
    if target.suffix.lower() not in PLOT_FORMATS:
        raise ValueError(f"--plot {path}: the file name must end in {', '.join(PLOT_FORMATS)}")
    if not target.parent.is_dir():
        raise ValueError(f"--plot {path}: the folder {target.parent} does not exist")
    if target.is_dir() or not os.access(target.parent, os.W_OK):
        raise ValueError(f"--plot {path}: cannot write a file there")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install matplotlib (or --plot '' for no plot)") from None
    return target
