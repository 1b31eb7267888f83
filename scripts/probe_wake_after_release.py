"""Probe (CUDA): does a wake of the weights slow down when much memory was released just before it? On qwen3-8b
a weights-only wake took 0.32 s beside a 3 GiB KV cache and 0.52 s beside a 108 GiB one, with the same 16.5 GB
copied (docs/benchmarks.md, the KV curve). The KV cache is released by the same sleep, so the suspect is the
driver still clearing the pages it got back while the wake maps and fills new ones.

This maps `--weights-gib` and `--released-gib` GiB in 64 MiB pieces (as the engine does), writes them, then sleeps:
copies the weights out to pinned host memory and unmaps both, in one of two `--orders` (the released memory before
the copy, or after it); waits `--delays` seconds, then maps the weights again and copies them back in, timed; each
case twice. No engine, no model: the driver and the link alone.

    python scripts/probe_wake_after_release.py --weights-gib 16 --released-gib 0,100 --delays 0,2
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from torpor.memory import cuda_driver
from torpor.memory.host_buffer import HostBuffer

GiB, PIECE = 1 << 30, 64 << 20


def map_pieces(vm: cuda_driver.VirtualMemory, address: int, size: int) -> list:
    return [(address + offset, vm.map(address + offset, PIECE)) for offset in range(0, size, PIECE)]


def unmap_pieces(vm: cuda_driver.VirtualMemory, pieces: list) -> None:
    for address, handle in pieces:
        vm.unmap(address, PIECE, handle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights-gib", type=int, default=16)
    parser.add_argument("--released-gib", default="0,100")
    parser.add_argument("--delays", default="0,2")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--orders", default="copy-first,released-first",
                        help="copy-first: copy the weights out, then unmap all (the engine's order before); "
                             "released-first: unmap the released memory first, then copy the weights out")
    args = parser.parse_args()
    torch.cuda.init()
    torch.cuda.synchronize()
    vm = cuda_driver.VirtualMemory(torch.cuda.current_device())
    weights = vm.round_up(args.weights_gib * GiB)
    largest = max(int(g) for g in args.released_gib.split(",")) * GiB
    w_address, r_address = vm.reserve(weights), vm.reserve(max(vm.round_up(largest), PIECE))
    host_buffer = HostBuffer.allocate(weights, "pinned")  # registered huge pages, as the engine's copies
    host = host_buffer.ptr
    stream = cuda_driver.stream_create()
    try:
        for released_gib in (int(g) for g in args.released_gib.split(",")):
            for delay in (float(d) for d in args.delays.split(",")):
                for order, repeat in itertools.product(args.orders.split(","), range(args.repeats)):
                    w = map_pieces(vm, w_address, weights)
                    r = map_pieces(vm, r_address, released_gib * GiB)
                    for address, _ in w + r:  # pages written, as a live KV cache's are
                        cuda_driver.memset_zero(address, PIECE, stream)
                    cuda_driver.stream_synchronize(stream)
                    start = time.perf_counter()
                    if order == "released-first":  # what is only dropped goes first, then the copy out
                        unmap_pieces(vm, r)
                    for offset in range(0, weights, PIECE):  # the sleep's copy of the weights, in the engine's chunks
                        cuda_driver.copy_d2h(host + offset, w_address + offset, PIECE, stream)
                    cuda_driver.stream_synchronize(stream)
                    unmap_pieces(vm, w if order == "released-first" else w + r)
                    released = time.perf_counter() - start
                    time.sleep(delay)
                    start = time.perf_counter()
                    w = map_pieces(vm, w_address, weights)
                    mapped = time.perf_counter() - start
                    for offset in range(0, weights, PIECE):
                        cuda_driver.copy_h2d(w_address + offset, host + offset, PIECE, stream)
                    cuda_driver.stream_synchronize(stream)
                    wake = time.perf_counter() - start
                    unmap_pieces(vm, w)
                    print(json.dumps({"order": order, "released_gib": released_gib, "delay_s": delay, "repeat": repeat,
                                      "sleep_s": round(released, 4), "map_s": round(mapped, 4),
                                      "wake_s": round(wake, 4), "wake_gbps": round(weights / wake / 1e9, 1)}),
                          flush=True)
    finally:
        host_buffer.free()
        vm.free_range(w_address, weights)
        vm.free_range(r_address, max(vm.round_up(largest), PIECE))


if __name__ == "__main__":
    main()
