"""Probe (CUDA): what waking discarded memory costs by piece size. A level-2 wake of qwen3-8b took 0.517 s
before its reload (docs/benchmarks.md) with no byte copied: every discarded segment is mapped again in
pieces of `MemoryManager(wake_piece_mib=...)` (cuMemCreate + cuMemMap + cuMemSetAccess each) and zero-filled. This maps
`--gib` GiB in pieces of each size, zero-fills it, unmaps it, and prints seconds and GB/s per piece size,
the zero-fill apart, to choose the piece size of zero-filled restores.

    python scripts/probe_map_pieces.py --gib 32
"""

from __future__ import annotations

import argparse
import time

import torch

from torpor.memory import cuda_driver

MiB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=int, default=32)
    parser.add_argument("--pieces-mib", default="2,64,256,1024,4096,whole")
    args = parser.parse_args()
    torch.cuda.init()
    torch.cuda.synchronize()
    vm = cuda_driver.VirtualMemory(torch.cuda.current_device())
    size = vm.round_up(args.gib << 30)
    address = vm.reserve(size)
    stream = cuda_driver.stream_create()
    try:
        for label in args.pieces_mib.split(","):
            piece = size if label == "whole" else vm.round_up(int(label) * MiB)
            start = time.perf_counter()
            handles = [(offset, min(piece, size - offset), vm.map(address + offset, min(piece, size - offset)))
                       for offset in range(0, size, piece)]
            mapped = time.perf_counter()
            for offset, n, _ in handles:
                cuda_driver.memset_zero(address + offset, n, stream)
            cuda_driver.stream_synchronize(stream)
            zeroed = time.perf_counter()
            for offset, n, handle in handles:
                vm.unmap(address + offset, n, handle)
            unmapped = time.perf_counter()
            print(f"{args.gib} GiB in {len(handles)} pieces of {label} MiB: map {mapped - start:.3f} s "
                  f"({size / 1e9 / (mapped - start):.0f} GB/s), zero-fill {zeroed - mapped:.3f} s, unmap "
                  f"{unmapped - zeroed:.3f} s", flush=True)
    finally:
        vm.free_range(address, size)


if __name__ == "__main__":
    main()
