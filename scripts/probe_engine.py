"""Where the device memory of a sleeping engine comes from, seen through the engine (GPU only).

    python scripts/probe_engine.py --part engine|phases|throughput [--model PRESET] [--gemm cublaslt|torch]

engine: start (graphs), sleep at level 1 and try the releases a sleeping engine could still make;
phases: memory outside every allocator after each phase of an engine's life (`--gemm torch` compares);
throughput: bench decode's 256-request workload timed by step kind, with the cuBLASLt plans it made.
"""

from __future__ import annotations

import argparse
import sys

import torch
from probe_residue import Meter, MiB, stack_limit, used


def engine(model: str) -> None:
    from torpor.engine import LLM, SamplingParams

    print(f"part 2: the engine ({model}), asleep at level 1")
    torch.zeros(1, device="cuda")
    torch.cuda.memory._record_memory_history(max_entries=200000)
    before = used()
    llm = LLM(model, device="cuda", max_num_seqs=64, max_model_len=2048)
    llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
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


def phases(model: str, gemm: str) -> None:
    """Device memory outside every allocator (context, libraries, kernel code) after each phase of an
    engine's life, to find which phase loads what stays while it sleeps."""

    from torpor.engine import LLM, SamplingParams

    torch.zeros(1, device="cuda")
    torch.cuda.memory._record_memory_history(max_entries=200000)  # stacks of what lands in the default pool
    bare = used()
    print(f"part phases ({model}), gemm={gemm}: bare context "
          f"{bare / MiB:.0f} MiB; outside allocators after each phase (MiB over bare):")
    llm = LLM(model, device="cuda", max_model_len=512, max_num_seqs=16, gemm=gemm)

    def report(what: str) -> None:
        audit = llm.memory.audit()
        print(f"  {what:<52} outside {((audit.other_bytes or 0) - bare) / MiB:+7.1f}  "
              f"default pool {audit.untagged_bytes / MiB:6.1f}  device used - bare {(used() - bare) / MiB:+8.1f}",
              flush=True)

    report("start-up (load, profile, KV cache, graphs)")
    prefix = list(range(3, 40))
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([[*prefix, 7, 8], [5] * 3], plain, use_tqdm=False)
    report("greedy prefill + decode")
    llm.generate([[*prefix, 7, 9]], SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1, max_tokens=8),
                 use_tqdm=False)
    report("seeded sampling")
    llm.generate([[4] * 9], SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, prompt_logprobs=1),
                 use_tqdm=False)
    report("logprobs + prompt logprobs")
    llm.generate([[*prefix, 11, 12]], plain, use_tqdm=False)
    report("prefill over a cached prefix (masked attention)")
    llm.sleep(1)
    report("asleep, level 1")
    llm.wake_up()
    llm.sleep(2)
    report("asleep, level 2")
    live_untagged_blocks(llm)


def throughput(model: str, gemm: str) -> None:
    """`bench decode`'s 256-request workload (qwen3-0.6b), timed by step kind (prefill / decode), with the
    cuBLASLt plans made and the seconds spent making them: to compare the `gemm` settings."""
    import argparse
    import time

    from torpor.cli.bench_decode import throughput_workload
    from torpor.engine import LLM, SamplingParams, cublaslt
    from torpor.engine.models import ModelConfig

    args = argparse.Namespace(seed=0, prompt_lens="32,512", output_lens="32,256", num_requests=256)
    prompts, output_lens = throughput_workload(args, ModelConfig.from_pretrained(model).vocab_size)
    llm = LLM(model, device="cuda", max_model_len=max(map(len, prompts)) + max(output_lens), max_num_seqs=256,
              gpu_memory_utilization=0.85, gemm=gemm)
    runner = llm.engine.executor.driver.runner
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
        llm.generate(prompts, params, use_tqdm=False)
        total = time.perf_counter() - start
        print(f"  gemm={gemm} run {attempt}: {total:.2f} s; " + "; ".join(
            f"{name} {sec:.2f} s / {num}" for name, (sec, num) in spent.items()), flush=True)


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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--part", choices=("engine", "phases", "throughput"), required=True)
    parser.add_argument("--gemm", choices=("cublaslt", "torch"), default="cublaslt", help="EngineConfig.gemm")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    from torpor.cli.bench_common import resolve_model

    model, _ = resolve_model(args.model, "cuda")
    if args.part == "engine":
        engine(model)
    else:
        {"phases": phases, "throughput": throughput}[args.part](model, args.gemm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
