"""`torpor demo`: the engine sleeps, wakes, and answers bit-identically.

Starts the engine on the embedded tiny model (or --model), answers a fixed batch of requests
(greedy and seeded sampling, with logprobs), then runs three sleep/wake cycles -- level 1 with a
full wake, level 1 with a selective wake (weights, then KV cache), level 2 with the weights
reloaded -- and after each checks that every answer is bit-identical to the first. Prints per-tag
memory awake / asleep / after the wake, the device memory in use (RSS on CPU), sleep and wake
times and copy speeds, and writes a plot of memory over the timeline.
"""

from __future__ import annotations

import argparse
import sys
import time

MiB = 2**20
CYCLES = {
    "level 1, full wake": (1, [None], False),
    "level 1, weights then kv_cache": (1, [["weights"], ["kv_cache"]], False),
    "level 2, weights + reload, kv_cache": (2, [["weights"], ["kv_cache"]], True),
}
PROMPTS = ["The engine fell asleep", "Memory comes back", "Every byte returns", "A quiet GPU",
           "Wake up and answer", "Offload, discard, keep", "Graphs stay valid", "Bit for bit"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="sleep and wake the engine and check every answer (the main job)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded tiny model)")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda or cuda:N")
    p.add_argument("--plot", default="torpor-demo-memory.png", help="where to write the memory plot ('' = none)")
    p.set_defaults(func=run)


class Timeline:
    """Device memory and per-tag resident bytes at each event of the demo."""

    def __init__(self, llm) -> None:
        self.llm, self.start, self.rows = llm, time.perf_counter(), []

    def mark(self, event: str) -> dict:
        usage = self.llm.memory_usage()
        row = dict(t=time.perf_counter() - self.start, event=event, device=usage["device_used_bytes"],
                   tags={tag: u["resident_bytes"] for tag, u in usage["tags"].items()})
        self.rows.append(row)
        return row

    def plot(self, path: str, device: str) -> None:
        """Per-tag resident bytes stacked at each event, and the memory in use on a second axis."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(11, 5))
        steps = range(len(self.rows))
        tags = list(self.rows[0]["tags"])
        ax.stackplot(steps, *[[r["tags"].get(t, 0) / MiB for r in self.rows] for t in tags], labels=tags,
                     step="post", alpha=0.8)
        ax.set_ylabel("tag memory resident, MiB (stacked)")
        used = ax.twinx()
        used.step(steps, [r["device"] / MiB for r in self.rows], where="post", color="black", linewidth=2,
                  label="process RSS" if device == "cpu" else "device memory in use")
        used.set_ylabel("MiB in use")
        used.set_ylim(bottom=0)
        ax.set_xticks(list(steps), [r["event"] for r in self.rows], rotation=40, ha="right", fontsize=7)
        ax.set_title(f"torpor demo on {device}: memory at each step of the timeline")
        ax.legend(loc="upper left", fontsize=8)
        used.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
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
    from rich.table import Table

    from torpor.engine import LLM
    from torpor.engine.sleep_harness import differences

    console = Console(width=160) if not sys.stdout.isatty() else Console()
    with console.status("preparing the model and starting the engine (the first run generates the tiny model)"):
        llm = LLM(args.model, device=args.device, max_num_seqs=16, max_model_len=512)
    device = str(llm.config.device)
    console.print(f"engine on {device}: {llm.config.model}")
    prompts, params = requests(llm)
    timeline = Timeline(llm)
    reference = llm.generate(prompts, params)
    console.print(f"first answer: {prompts[0]!r} -> {reference[0].outputs[0].text!r}")
    table = Table(title=f"torpor demo on {device}: per-tag MiB resident (awake / asleep / after wake)")
    tags = list(llm.memory_usage()["tags"])
    for col in ("cycle", *tags, "memory in use MiB" + (" (RSS)" if device == "cpu" else ""), "sleep", "wake",
                "answers"):
        table.add_column(col, justify="right")
    ok = True
    for name, (level, wakes, reload) in CYCLES.items():
        r = cycle(llm, level, wakes, reload, timeline)
        same = not differences(reference, llm.generate(prompts, params))
        ok &= same
        cells = [f"{r['before']['tags'][t] / MiB:.1f} / {r['asleep']['tags'][t] / MiB:.1f} / "
                 f"{r['after']['tags'][t] / MiB:.1f}" for t in tags]
        table.add_row(name, *cells,
                      f"{r['before']['device'] / MiB:.0f} / {r['asleep']['device'] / MiB:.0f} / "
                      f"{r['after']['device'] / MiB:.0f}",
                      _speed(r["sleep_s"], r["sleep_bytes"]), _speed(r["wake_s"], r["wake_bytes"]),
                      "bit-identical" if same else "DIFFERENT")
    timeline.mark("end")
    console.print(table)
    sizes = ", ".join(f"{t} {u['allocated_bytes'] / MiB:.2f}" for t, u in llm.memory_usage()["tags"].items())
    console.print(f"bytes in live tensors per tag (MiB): {sizes}")
    if args.plot:
        timeline.plot(args.plot, device)
        console.print(f"memory plot written to {args.plot}")
    console.print("every answer bit-identical to the first" if ok else "[red]answers differ after a wake[/red]")
    return 0 if ok else 1


def _speed(seconds: float, nbytes: int) -> str:
    rate = f", {nbytes / seconds / 1e9:.1f} GB/s" if seconds > 0 and nbytes else ""
    return f"{seconds * 1e3:.0f} ms{rate}"
