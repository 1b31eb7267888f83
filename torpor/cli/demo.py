"""`torpor demo`: a model's worth of tensors goes to sleep and wakes up, bit-identically.

Builds a small transformer-shaped workload in four tags (weights; a KV cache nested in runtime
state; workspace), computes an answer, sleeps like an inference engine at level 1 (weights and
runtime offloaded, KV cache and workspace discarded), wakes, checks the answer is bit-identical,
then does a level-2 cycle (weights discarded and reloaded into the same tensors). Prints what
each tag held awake, asleep and after the wake, device memory (RSS on CPU), and the speed.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

MiB = 2**20


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="sleep and wake a model's worth of tensors and check the answers",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--size-mib", type=int, default=None, help="weight bytes (default: 2048 on GPU, 256 on CPU)")
    p.set_defaults(func=run)


def build(mm, device: torch.device, size_mib: int) -> dict:
    """Weights of about `size_mib` MiB (1024x1024 fp32 layers), a KV cache, block tables, a workspace."""
    hidden = 1024
    layers = max(1, size_mib * MiB // (hidden * hidden * 4))
    with mm.tag("weights"):
        weights = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers)]).to(device)
    with mm.tag("runtime"):
        with mm.tag("kv_cache"):
            kv_cache = torch.zeros(layers, 256, hidden, device=device)
        block_tables = torch.randint(0, 256, (64, 32), dtype=torch.int32, device=device)
    with mm.tag("workspace"):
        workspace = torch.empty(16 * MiB // 4, device=device)
    return dict(weights=weights, kv_cache=kv_cache, block_tables=block_tables, workspace=workspace)


@torch.no_grad()
def answer(state: dict) -> torch.Tensor:
    """A deterministic function of every live tag (weights, runtime); the KV cache is rebuilt."""
    x = state["block_tables"].float()[:, :1].expand(64, 1024) / 256
    state["kv_cache"][:, :64].copy_(x)  # the engine refills its cache after a wake
    for layer in state["weights"]:
        x = torch.tanh(layer(x) + state["kv_cache"][0, :64])
    return x


def used(mm) -> int:
    return mm.device_used_bytes()


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from torpor.memory import MemoryManager

    console = Console(width=200) if not sys.stdout.isatty() else Console()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    size = args.size_mib or (2048 if device.type == "cuda" else 256)
    mm = MemoryManager(device)
    state = build(mm, device, size)
    reference = answer(state).clone()
    snapshot = {name: p.detach().clone().cpu() for name, p in state["weights"].named_parameters()}
    ok = True
    table = Table(title=f"torpor.memory on {device}: per-tag MiB (awake / asleep / after wake)")
    for col in ("cycle", *mm.tags(), "memory in use MiB", "sleep", "wake", "identical"):
        table.add_column(col, justify="right")
    plans = {"level 1": {"weights": "offload", "runtime": "offload", "kv_cache": "discard", "workspace": "discard"},
             "level 2": {"weights": "discard", "runtime": "offload", "kv_cache": "discard", "workspace": "discard"}}
    for cycle, plan in plans.items():
        before, used_before = mm.usage(), used(mm)
        slept = mm.sleep(plan)
        asleep, used_asleep = mm.usage(), used(mm)
        woke = mm.wake()
        if plan["weights"] == "discard":  # level 2: the weights come back from their source
            start = time.perf_counter()
            for name, p in state["weights"].named_parameters():
                p.data.copy_(snapshot[name])
            console.print(f"{cycle}: reloaded weights in {time.perf_counter() - start:.3f} s")
        after, used_after = mm.usage(), used(mm)
        same = torch.equal(answer(state), reference)
        ok &= same
        cells = [f"{before[t].resident_bytes / MiB:.0f} / {asleep[t].resident_bytes / MiB:.0f} / "
                 f"{after[t].resident_bytes / MiB:.0f}" for t in mm.tags()]
        table.add_row(cycle, *cells, f"{used_before / MiB:.0f} / {used_asleep / MiB:.0f} / {used_after / MiB:.0f}",
                      f"{slept.seconds * 1e3:.0f} ms, {slept.copy_gbps:.1f} GB/s",
                      f"{woke.seconds * 1e3:.0f} ms, {woke.copy_gbps:.1f} GB/s", "yes" if same else "NO")
    console.print(table)
    console.print("every answer bit-identical to the first" if ok else "[red]answers differ after a wake[/red]")
    return 0 if ok else 1
