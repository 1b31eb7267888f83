"""Where the device memory that stays while the engine sleeps comes from (GPU only).

Part 1 adds one CUDA feature at a time to a bare context and prints what each costs (mem_get_info).
Part 2 starts the engine (tiny model, graphs), sleeps it at level 1 and tries, one by one, the
releases a sleeping engine could make: cuBLAS workspaces, the default pool, the stack reservation.

    python scripts/probe_residue.py --part features|engine [--model PATH_OR_PRESET]
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


def engine(model: str) -> None:
    from torpor.engine import LLM, SamplingParams

    print(f"part 2: the engine ({model}), asleep at level 1")
    torch.zeros(1, device="cuda")
    torch.cuda.memory._record_memory_history(max_entries=200000)
    before = used()
    llm = LLM(model, device="cuda", max_num_seqs=64, max_model_len=2048)
    llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=8, ignore_eos=True))
    print(f"  awake: +{(used() - before) / MiB:.0f} MiB over the process before start-up; "
          f"stack limit {stack_limit()} B/thread")
    llm.sleep(1)
    audit = llm.memory.audit()
    print(f"  asleep: +{(used() - before) / MiB:.0f} MiB; audit: tagged {audit.tagged_bytes / MiB:.1f}, "
          f"default pool {audit.untagged_bytes / MiB:.1f}, outside allocators {(audit.other_bytes or 0) / MiB:.1f} MiB")
    live_untagged_blocks(llm)
    meter = Meter()
    torch.cuda.empty_cache()
    meter("empty_cache")
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    meter("clear cuBLAS workspaces + empty_cache")
    stack_limit(1024)
    meter("stack limit back to 1024 B")
    torch.cuda.synchronize()
    print(f"  memory_stats: {torch.cuda.memory_stats().get('reserved_bytes.all.current', 0) / MiB:.1f} MiB reserved")


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


def phases(model: str) -> None:
    """Device memory outside every allocator (context, libraries, kernel code) after each phase of an
    engine's life, to find which phase loads what stays while it sleeps."""
    import os

    from torpor.engine import LLM, SamplingParams

    torch.zeros(1, device="cuda")
    torch.cuda.memory._record_memory_history(max_entries=200000)  # stacks of what lands in the default pool
    bare = used()
    print(f"part phases ({model}), TORPOR_GEMM={os.environ.get('TORPOR_GEMM', '(unset)')}: bare context "
          f"{bare / MiB:.0f} MiB; outside allocators after each phase (MiB over bare):")
    llm = LLM(model, device="cuda", max_model_len=512, max_num_seqs=16)

    def report(what: str) -> None:
        audit = llm.memory.audit()
        print(f"  {what:<52} outside {((audit.other_bytes or 0) - bare) / MiB:+7.1f}  "
              f"default pool {audit.untagged_bytes / MiB:6.1f}  device used - bare {(used() - bare) / MiB:+8.1f}",
              flush=True)

    report("start-up (load, profile, KV cache, graphs)")
    prefix = list(range(3, 40))
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([[*prefix, 7, 8], [5] * 3], plain)
    report("greedy prefill + decode")
    llm.generate([[*prefix, 7, 9]], SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1, max_tokens=8))
    report("seeded sampling")
    llm.generate([[4] * 9], SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, prompt_logprobs=1))
    report("logprobs + prompt logprobs")
    llm.generate([[*prefix, 11, 12]], plain)
    report("prefill over a cached prefix (masked attention)")
    llm.sleep(1)
    report("asleep, level 1")
    llm.wake_up()
    llm.sleep(2)
    report("asleep, level 2")
    live_untagged_blocks(llm)


def throughput(model: str) -> None:
    """`bench decode`'s 256-request workload (qwen3-0.6b), timed by step kind (prefill / decode), with the
    cuBLASLt plans made and the seconds spent making them: to compare TORPOR_GEMM settings."""
    import argparse
    import os
    import time

    from torpor.cli.bench_decode import throughput_workload
    from torpor.engine import LLM, SamplingParams, cublaslt
    from torpor.engine.models import ModelConfig

    args = argparse.Namespace(seed=0, prompt_lens="32,512", output_lens="32,256", num_requests=256)
    prompts, output_lens = throughput_workload(args, ModelConfig.from_pretrained(model).vocab_size)
    llm = LLM(model, device="cuda", max_model_len=max(map(len, prompts)) + max(output_lens), max_num_seqs=256,
              gpu_memory_utilization=0.85)
    runner = llm.engine.model_runner
    spent = {"prefill": [0.0, 0], "decode": [0.0, 0], "plans": [0.0, 0]}
    run, make_plan = runner.run, cublaslt.CublasLt._make_plan

    def timed_run(seqs, is_prefill):
        start = time.perf_counter()
        out = run(seqs, is_prefill)
        torch.cuda.synchronize()
        entry = spent["prefill" if is_prefill else "decode"]
        entry[0] += time.perf_counter() - start
        entry[1] += 1
        return out

    def timed_plan(self, key):
        start = time.perf_counter()
        plan = make_plan(self, key)
        spent["plans"][0] += time.perf_counter() - start
        spent["plans"][1] += 1
        return plan

    runner.run, cublaslt.CublasLt._make_plan = timed_run, timed_plan
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    for attempt in (1, 2):
        for entry in spent.values():
            entry[:] = [0.0, 0]
        start = time.perf_counter()
        llm.generate(prompts, params)
        total = time.perf_counter() - start
        print(f"  TORPOR_GEMM={os.environ.get('TORPOR_GEMM', '(unset)')} run {attempt}: {total:.2f} s; " + "; ".join(
            f"{name} {sec:.2f} s / {num}" for name, (sec, num) in spent.items()), flush=True)


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


def live_untagged_blocks(llm, top: int = 12) -> None:
    """The live blocks in segments of no tag, largest first, with where they were allocated."""
    tagged = set(llm.memory._backend.segments)
    blocks, holding = [], {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        if seg["address"] in tagged:
            continue
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                frames = [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in block.get("frames", [])
                          if "torpor" in f["filename"] or "torch/" in f["filename"]][:6]
                blocks.append((block["size"], seg["total_size"], frames))
                holding[seg["address"]] = seg["total_size"]
    print(f"  live blocks outside tags: {len(blocks)}, {sum(b[0] for b in blocks) / MiB:.1f} MiB "
          f"in segments of {sum(holding.values()) / MiB:.1f} MiB")
    for size, seg_size, frames in sorted(blocks, key=lambda b: -b[0])[:top]:
        where = " <- ".join(frames) or "(no python frame)"
        print(f"    {size / MiB:8.2f} MiB (segment {seg_size / MiB:.0f} MiB) {where}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny")
    parts = ("features", "engine", "phases", "throughput", "pinning", "cublas", "host-memory", "cublas-config")
    parser.add_argument("--part", choices=parts, required=True, help="run each in its own process")
    parser.add_argument("--blas", choices=("cublas", "cublaslt"), default=None,
                        help="torch.backends.cuda.preferred_blas_library for the cublas-config part")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    from torpor.cli.bench_sleep import resolve_model

    if args.part == "features":
        features()
    elif args.part == "pinning":
        pinning()
    elif args.part == "throughput":
        throughput(resolve_model(args.model, "cuda"))
    elif args.part == "phases":
        phases(resolve_model(args.model, "cuda"))
    elif args.part == "host-memory":
        host_memory()
    elif args.part == "cublas-config":
        if args.blas:
            torch.backends.cuda.preferred_blas_library(args.blas)
        print(f"  preferred BLAS library: {torch.backends.cuda.preferred_blas_library()}")
        cublas_config()
    elif args.part == "cublas":
        cublas_handles()
    else:
        engine(resolve_model(args.model, "cuda"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
