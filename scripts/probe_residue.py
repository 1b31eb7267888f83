"""Where the device memory that stays while an engine sleeps comes from, in a bare process (GPU only).
Each part in its own process:

    python scripts/probe_residue.py --part features|pinning|cublas|cublas-config|host-memory

features: one CUDA feature at a time on a bare context and what each costs (mem_get_info);
pinning: seconds to pin host memory, several ways; cublas: cuBLAS / cuBLASLt handles created directly;
cublas-config: a handle's cost and GEMM speed under CUBLAS_WORKSPACE_CONFIG / --blas;
host-memory: the device memory the driver keeps for pinned host memory, three ways.
The engine-side probes are in probe_engine.py.
"""

from __future__ import annotations

import argparse
import sys

import torch

MiB = 2**20


def used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


class Meter:
    def __init__(self) -> None:
        self.last = used()

    def __call__(self, what: str) -> None:
        now = used()
        reserved = torch.cuda.memory_reserved() / MiB
        print(f"  {what:<58} {(now - self.last) / MiB:+8.1f} MiB  (used {now / MiB:8.1f}, default pool {reserved:.0f})",
              flush=True)
        self.last = now


def stack_limit(value: int | None = None) -> int:
    from torpor.memory.cuda_driver import check, driver

    d = driver()
    if value is not None:
        check("cuCtxSetLimit", d.cuCtxSetLimit(d.CUlimit.CU_LIMIT_STACK_SIZE, value))
    return int(check("cuCtxGetLimit", d.cuCtxGetLimit(d.CUlimit.CU_LIMIT_STACK_SIZE)))


def features() -> None:
    print("part 1: features on a bare context")
    torch.zeros(1, device="cuda")
    meter = Meter()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    meter("two 32 MiB tensors (expected +64)")
    torch.cuda.current_blas_handle()
    meter("cuBLAS handle alone (no GEMM yet)")
    b = a @ a
    meter("first bf16 matmul on the default stream (cuBLAS handle + workspace)")
    torch.nn.functional.linear(a, a, a[0])
    meter("linear with bias (cuBLASLt)")
    s = torch.cuda.Stream()
    meter("first torch.cuda.Stream() (PyTorch's stream pool)")
    with torch.cuda.stream(s):
        b = a @ a
    torch.cuda.synchronize()
    meter("matmul on that stream (second cuBLAS workspace)")
    from torpor.memory import cuda_driver

    cuda_driver.stream_create()
    meter("driver-made stream")
    x = torch.randn(64, 151936, device="cuda")
    torch.multinomial(torch.softmax(x, -1), 1)
    torch.topk(x, 20)
    torch.sort(x, dim=-1)
    meter("sampler-like ops (softmax, multinomial, topk, sort)")
    del a, b, x
    torch.cuda.empty_cache()
    meter("free tensors + empty_cache")
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    meter("clear cuBLAS workspaces + empty_cache")
    print(f"  stack limit {stack_limit()} B/thread")


def pinning(gib: float = 8.0) -> None:
    """Seconds to pin `gib` GiB of host memory: cuMemHostAlloc against mmap + transparent huge pages +
    parallel first touch + cuMemHostRegister; and to free each."""
    import ctypes
    import mmap
    import time
    from concurrent.futures import ThreadPoolExecutor

    from torpor.memory.cuda_driver import check, driver, host_alloc_pinned, host_free_pinned

    size = int(gib * 2**30)
    torch.zeros(1, device="cuda")
    d = driver()
    start = time.perf_counter()
    ptr = host_alloc_pinned(size)
    alloc_s = time.perf_counter() - start
    start = time.perf_counter()
    host_free_pinned(ptr)
    free_s = time.perf_counter() - start
    print(f"  cuMemHostAlloc {gib:.0f} GiB: {alloc_s:.2f} s ({gib / alloc_s:.1f} GiB/s), free {free_s:.2f} s")
    for threads in (1, 8, 16):
        start = time.perf_counter()
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        anchor = ctypes.c_char.from_buffer(m)
        base = ctypes.addressof(anchor)
        m.madvise(14)  # MADV_HUGEPAGE
        step = size // threads
        with ThreadPoolExecutor(threads) as pool:  # ctypes.memset releases the GIL
            list(pool.map(ctypes.memset, [base + i * step for i in range(threads)], [0] * threads, [step] * threads))
        touched = time.perf_counter() - start
        check("cuMemHostRegister", d.cuMemHostRegister(base, size, 0))
        total = time.perf_counter() - start
        start = time.perf_counter()
        check("cuMemHostUnregister", d.cuMemHostUnregister(base))
        del anchor
        m.close()
        print(f"  mmap+THP+{threads} threads touch+register {gib:.0f} GiB: {total:.2f} s ({gib / total:.1f} GiB/s; "
              f"touch {touched:.2f} s), unregister+unmap {time.perf_counter() - start:.2f} s")


def cublas_handles() -> None:
    """What creating cuBLAS and cuBLASLt handles costs in a bare process, called directly (ctypes on the
    libraries torch loads), to tell the handles' own memory (freed by destroy) from kernel code (stays)."""
    import ctypes
    import os

    torch.zeros(1, device="cuda")
    print(f"  CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', '(unset)')}")
    meter = Meter()
    with open("/proc/self/maps") as f:  # the libraries torch linked, already loaded
        paths = {line.split()[-1] for line in f if ".so" in line}
    libs = {}
    for name in ("cublas", "cublasLt"):
        found = sorted(p for p in paths if p.rsplit("/", 1)[-1].startswith(f"lib{name}.so"))
        libs[name] = ctypes.CDLL(found[0] if found else f"lib{name}.so")
    lt = ctypes.c_void_p()
    status = libs["cublasLt"].cublasLtCreate(ctypes.byref(lt))
    meter(f"cublasLtCreate first (status {status})")
    for attempt in (1, 2):
        handle = ctypes.c_void_p()
        status = libs["cublas"].cublasCreate_v2(ctypes.byref(handle))
        meter(f"cublasCreate_v2 #{attempt} (status {status})")
        libs["cublas"].cublasDestroy_v2(handle)
        meter(f"cublasDestroy_v2 #{attempt}")
    libs["cublasLt"].cublasLtDestroy(lt)
    meter("cublasLtDestroy")
    torch.cuda.current_blas_handle()
    meter("PyTorch's handle for this thread (workspace included)")


def cublas_config() -> None:
    """Under this process's CUBLAS_WORKSPACE_CONFIG: what a cuBLAS handle costs (direct and PyTorch's) and
    how fast qwen3-8b's GEMMs run through PyTorch (to see whether a smaller cuBLAS pool slows them)."""
    import ctypes
    import os

    torch.zeros(1, device="cuda")
    print(f"  CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG', '(unset)')}")
    meter = Meter()
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if ".so" in line}
    found = sorted(p for p in paths if p.rsplit("/", 1)[-1].startswith("libcublas.so"))
    lib = ctypes.CDLL(found[0] if found else "libcublas.so")
    handle = ctypes.c_void_p()
    lib.cublasCreate_v2(ctypes.byref(handle))
    meter("cublasCreate_v2")
    lib.cublasDestroy_v2(handle)
    meter("cublasDestroy_v2")
    torch.cuda.current_blas_handle()
    meter("PyTorch's handle (+ its workspace in the default pool)")
    x = torch.randn(2048, 12288, device="cuda", dtype=torch.bfloat16)
    shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}
    weights = {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for name, (k, n) in shapes.items()}
    for rows in (1, 8, 64, 2048):
        line = []
        for name, (k, _) in shapes.items():
            a, w = x[:rows, :k], weights[name]
            for _ in range(3):
                torch.nn.functional.linear(a, w)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                torch.nn.functional.linear(a, w)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end) / 20
            line.append(f"{name} {ms * 1000:7.1f} us {w.nbytes / ms / 1e6:6.0f} GB/s")
        print(f"    M={rows:<5} " + " | ".join(line))
    meter("after the GEMMs (tensors stay)")


def host_memory(gib: float = 8.0) -> None:
    """Device memory the driver keeps for pinned host memory, three ways: cuMemHostAlloc, registered
    anonymous memory, and host-located VMM allocations (cuMemCreate on the host, mapped for the device
    at 2 MiB granularity); and the copy speed into/out of each."""
    import ctypes
    import mmap
    import time

    from torpor.memory.cuda_driver import check, driver, host_alloc_pinned, host_free_pinned

    cu = driver()
    size = int(gib * 2**30)
    torch.zeros(1, device="cuda")
    dev = torch.empty(size // 4, dtype=torch.uint8, device="cuda")  # 1/4 of it, copied 4 times
    stream = torch.cuda.current_stream().cuda_stream
    meter = Meter()

    def speed(ptr: int) -> str:
        out = []
        for name, copy in (("d2h", cu.cuMemcpyDtoHAsync), ("h2d", cu.cuMemcpyHtoDAsync)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for i in range(4):
                host = ptr + i * dev.numel()
                args = (host, dev.data_ptr()) if name == "d2h" else (dev.data_ptr(), host)
                check(name, copy(*args, dev.numel(), stream))
            torch.cuda.synchronize()
            out.append(f"{name} {size / (time.perf_counter() - start) / 1e9:.1f} GB/s")
        return ", ".join(out)

    ptr = host_alloc_pinned(size)
    meter(f"cuMemHostAlloc {gib:.0f} GiB")
    print(f"    {speed(ptr)}")
    host_free_pinned(ptr)
    meter("cuMemFreeHost")
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anchor = ctypes.c_char.from_buffer(m)
    base = ctypes.addressof(anchor)
    m.madvise(14)  # MADV_HUGEPAGE
    ctypes.memset(base, 0, size)
    check("cuMemHostRegister", cu.cuMemHostRegister(base, size, 0))
    meter(f"mmap + THP + cuMemHostRegister {gib:.0f} GiB")
    print(f"    {speed(base)}")
    check("cuMemHostUnregister", cu.cuMemHostUnregister(base))
    del anchor
    m.close()
    meter("unregister + unmap")
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
    prop.location.id = 0
    for flag in ("MINIMUM", "RECOMMENDED"):
        g = check("granularity", cu.cuMemGetAllocationGranularity(
            prop, getattr(cu.CUmemAllocationGranularity_flags, f"CU_MEM_ALLOC_GRANULARITY_{flag}")))
        print(f"    host-located VMM granularity {flag.lower()}: {int(g) / MiB:.3f} MiB")
    start = time.perf_counter()
    handle = check("cuMemCreate(host)", cu.cuMemCreate(size, prop, 0))
    address = int(check("cuMemAddressReserve", cu.cuMemAddressReserve(size, 2 * MiB, 0, 0)))
    check("cuMemMap", cu.cuMemMap(address, size, 0, handle, 0))
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = torch.cuda.current_device()
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    check("cuMemSetAccess", cu.cuMemSetAccess(address, size, [access], 1))
    made = time.perf_counter() - start
    meter(f"cuMemCreate on the host {gib:.0f} GiB, mapped for the device ({made:.2f} s)")
    print(f"    {speed(address)}")
    start = time.perf_counter()
    check("cuMemUnmap", cu.cuMemUnmap(address, size))
    check("cuMemRelease", cu.cuMemRelease(handle))
    check("cuMemAddressFree", cu.cuMemAddressFree(address, size))
    meter(f"unmap + release ({time.perf_counter() - start:.2f} s)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parts = ("features", "pinning", "cublas", "host-memory", "cublas-config")
    parser.add_argument("--part", choices=parts, required=True, help="run each in its own process")
    parser.add_argument("--blas", choices=("cublas", "cublaslt"), default=None,
                        help="torch.backends.cuda.preferred_blas_library for the cublas-config part")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    if args.part == "features":
        features()
    elif args.part == "pinning":
        pinning()
    elif args.part == "host-memory":
        host_memory()
    elif args.part == "cublas-config":
        if args.blas:
            torch.backends.cuda.preferred_blas_library(args.blas)
        print(f"  preferred BLAS library: {torch.backends.cuda.preferred_blas_library()}")
        cublas_config()
    else:
        cublas_handles()
    return 0


if __name__ == "__main__":
    sys.exit(main())
