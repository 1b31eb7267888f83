"""Probe (CUDA, driver >= 570): does the driver's checkpoint/restore of this process's CUDA context cost time
per byte of *pinned host memory* the process holds? A level-3 sleep of qwen3-8b keeps the weights' 15.6 GB
host copy pinned (registered): its context checkpoint took 0.71 s and restore 0.78 s, against 0.44 s / 0.37 s
at level 4, where that copy is gone (docs/benchmarks.md). This holds a small context (one 64 MiB tensor), pins
`--gib` sizes of host memory the way torpor's host copies are pinned (huge-page mmap + cuMemHostRegister,
`HostBuffer`), and times checkpoint and restore (the driver's calls apart) at each size.

    python scripts/probe_checkpoint_pinned.py --gib 0,4,16
"""

from __future__ import annotations

import argparse
import time

import torch

from torpor.memory import checkpoint, cuda_driver
from torpor.memory.host_buffer import HostBuffer


def cycle(label: str) -> None:
    torch.cuda.synchronize()
    start = time.perf_counter()
    taken = checkpoint.checkpoint_process(cuda_driver.pci_bus_id(torch.cuda.current_device()))
    back = checkpoint.restore_process()
    total = time.perf_counter() - start
    print(f"{label}: checkpoint {taken.seconds:.3f} s {taken.driver_s}, restore {back.seconds:.3f} s "
          f"{back.driver_s}; whole cycle {total:.3f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", default="0,4,16", help="pinned host GiB to hold, one cycle each")
    args = parser.parse_args()
    keep = torch.ones(16 << 20, device="cuda")  # a context with a little device memory, like an asleep engine
    checkpoint.check_support(cuda_driver.pci_bus_id(torch.cuda.current_device()))
    for gib in (int(g) for g in args.gib.split(",")):
        buffer = HostBuffer.allocate(gib << 30, "pinned") if gib else None
        try:
            cycle(f"{gib} GiB pinned host memory ({'registered mmap' if buffer and buffer._registered else 'none'})")
            if buffer is not None and buffer._registered:  # what dropping the pin around a checkpoint would cost
                start = time.perf_counter()
                cuda_driver.host_unregister(buffer.ptr)
                middle = time.perf_counter()
                cuda_driver.host_register(buffer.ptr, buffer.size)
                print(f"  unregister {middle - start:.3f} s, register again {time.perf_counter() - middle:.3f} s "
                      "(pages already touched)", flush=True)
        finally:
            if buffer is not None:
                buffer.free()
        if gib:  # the driver's own pinned allocation, for comparison
            ptr = cuda_driver.host_alloc_pinned(gib << 30)
            try:
                cycle(f"{gib} GiB pinned host memory (cuMemHostAlloc)")
            finally:
                cuda_driver.host_free_pinned(ptr)
    assert float(keep.sum()) == keep.numel(), "device memory changed across checkpoint/restore"


if __name__ == "__main__":
    main()
