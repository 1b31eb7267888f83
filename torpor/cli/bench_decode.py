"""`torpor bench decode`: decode speed against the memory roofline, and batched throughput against Hugging Face
transformers. Synthetic checkpoints are generated into the cache when missing.

1. The roofline: a device-to-device copy, bytes read + bytes written per second (what the memory sustains for a
   streaming kernel), measured in the same run.
2. Batch 1, per model (`--models`): greedy decode with CUDA graphs through `LLM.generate`; seconds per decode
   step = (a generate of 1 + `--decode-tokens` tokens - a generate of 1 token) / `--decode-tokens`, so the
   prefill is not counted; tokens/s; the bytes each step must read (every weight, the embedding table only where
   it is also the LM head, plus the KV cache so far) per second, as a fraction of the roofline. The device's
   busy time per step (torch's profiler, the same subtraction) splits the kernels' time from the host's.
3. Throughput (`--throughput-model`): `--num-requests` requests with random prompt and output lengths through
   `LLM.generate`, then through transformers' `generate` (batches of `--hf-batch-size`, left-padded, same
   checkpoint, dtype and device); output tokens/s of each and the ratio. transformers runs each batch for its
   longest output, so only the tokens requested count for it too.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from torpor.cli.bench_common import (
    GB,
    Run,
    add_json_option,
    check_json_path,
    console,
    copy_bandwidth,
    fmt_bytes,
    fmt_pct,
    fmt_rate,
    fmt_s,
    profiled,
    progress,
    release,
    resolve_device,
    resolve_model,
    sync,
    table,
    tensor_bytes,
    write_json,
)

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
PROFILED_STEPS = 64  # decode steps whose device time is measured (under the profiler: slower on the host)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("decode", help="decode tokens/s vs the memory roofline, throughput vs transformers",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N (cpu only for smoke tests)")
    p.add_argument("--models", default="qwen3-8b,qwen3-0.6b", help="presets or folders for the batch-1 runs")
    p.add_argument("--throughput-model", default="qwen3-0.6b", help="preset for the throughput run ('' skips it)")
    p.add_argument("--cache-dir", default=None, help="where presets are generated (default: $TORPOR_CACHE/models)")
    p.add_argument("--prompt-len", type=int, default=128, help="batch 1: prompt tokens")
    p.add_argument("--decode-tokens", type=int, default=256, help="batch 1: decode steps timed")
    p.add_argument("--num-requests", type=int, default=256, help="throughput: requests")
    p.add_argument("--prompt-lens", default="32,512", help="throughput: min,max prompt tokens")
    p.add_argument("--output-lens", default="32,256", help="throughput: min,max output tokens")
    p.add_argument("--max-num-seqs", type=int, default=256, help="throughput: the engine's batch limit")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="throughput: the engine's budget")
    p.add_argument("--hf-batch-size", type=int, default=64, help="throughput: transformers batch size")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--copy-gib", type=float, default=4.0, help="buffer size of the copy-bandwidth test")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks (GPUs) per engine; the roofline fraction is then per GPU (rank 0's shard)")
    p.add_argument("--tp-comm", choices=("nccl", "torpor"), default="nccl",
                   help="tensor parallelism's collectives (EngineConfig.tp_comm)")
    p.add_argument("--sleep-cycle", action="store_true",
                   help="batch 1: measure again after a level-1 sleep and a full wake (the sleep's effect on speed)")
    p.add_argument("--seed", type=int, default=0)
    add_json_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    check_json_path(args.json)
    run_ = Run(device, "")
    results: dict = {"run": run_.describe(), "tensor_parallel_size": args.tensor_parallel_size,
                     "tp_comm": args.tp_comm}
    progress("the device's copy bandwidth")
    results["copy_gbps"] = copy_bandwidth(device, int(args.copy_gib * 2**30))
    results["batch1"] = []
    for name in filter(None, args.models.split(",")):
        path, label = resolve_model(name, device, cache_dir=args.cache_dir)
        progress(f"{label}: batch-1 decode")
        results["batch1"].append({"model": label, **bench_batch1(path, device, args, results["copy_gbps"])})
    if args.throughput_model:
        path, label = resolve_model(args.throughput_model, device, cache_dir=args.cache_dir)
        progress(f"{label}: {args.num_requests} requests")
        results["throughput"] = {"model": label, **bench_throughput(path, device, args)}
    report(run_, results, args)
    write_json(args.json, results)
    return 0


def engine(path: str, device: str, args: argparse.Namespace, **options):
    from torpor import LLM  # (the bench modules import torpor's engine when they run, not at `torpor`'s start)

    return LLM(path, device=device, tensor_parallel_size=args.tensor_parallel_size, tp_comm=args.tp_comm,
               **options)


def step_bytes(path: str, tensor_parallel_size: int) -> tuple[int, int]:
    """(weight bytes one decode step reads, KV-cache bytes per token), per rank: every tensor of the checkpoint,
    except the embedding table where the LM head is separate (a step looks up one row of it); the KV cache's
    K and V of every layer."""
    config = json.loads((Path(path) / "config.json").read_text())
    sizes = tensor_bytes(path)
    weights = sum(sizes.values())
    embed = next((n for n in sizes if n.endswith("embed_tokens.weight")), None)
    if embed is not None and "lm_head.weight" in sizes:
        weights -= sizes[embed] - sizes[embed] // config["vocab_size"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    kv = config["num_hidden_layers"] * 2 * kv_heads * head_dim * ITEMSIZE[config.get("torch_dtype", "float32")]
    return weights // tensor_parallel_size, kv // tensor_parallel_size


def generate_seconds(llm, prompt: list[int], max_tokens: int, device: str) -> float:
    from torpor import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sync(device)
    start = time.perf_counter()
    llm.generate([prompt], params)
    sync(device)
    return time.perf_counter() - start


def decode_step_seconds(llm, prompt: list[int], steps: int, device: str) -> float:
    """Seconds per decode step: a generate of 1 + `steps` tokens less one of 1 token (the prefill and the first
    token: the median of 3), over `steps`."""
    first = sorted(generate_seconds(llm, prompt, 1, device) for _ in range(3))[1]
    return (generate_seconds(llm, prompt, 1 + steps, device) - first) / steps


def device_step_seconds(llm, prompt: list[int], steps: int, device: str) -> float | None:
    """The device's busy seconds per decode step (kernels and copies, torch's profiler): a generate of
    1 + `steps` tokens less one of 1, over `steps`; None off CUDA."""
    if not device.startswith("cuda"):
        return None
    busy = [profiled(lambda n=n: generate_seconds(llm, prompt, n, device), device)[1] for n in (1, 1 + steps)]
    return (busy[1] - busy[0]) / steps


def bench_batch1(path: str, device: str, args: argparse.Namespace, copy_gbps: float) -> dict:
    max_model_len = args.prompt_len + args.decode_tokens + 16
    llm = engine(path, device, args, max_model_len=max_model_len, max_num_seqs=1,
                 num_kv_blocks=-(-max_model_len // 16), block_size=16)
    prompt = random_tokens(random.Random(args.seed), args.prompt_len, vocab(path))
    generate_seconds(llm, prompt, 8, device)  # warm-up
    steps = args.decode_tokens
    step_s = decode_step_seconds(llm, prompt, steps, device)
    weights, kv_per_token = step_bytes(path, args.tensor_parallel_size)
    # decode step k (1..steps) attends over prompt_len + k tokens
    nbytes = weights + kv_per_token * (args.prompt_len + (steps + 1) / 2)
    device_s = device_step_seconds(llm, prompt, min(steps, PROFILED_STEPS), device)
    row = {"tokens_per_s": 1 / step_s, "step_s": step_s, "bytes_per_step": nbytes,
           "gbps": nbytes / step_s / GB, "roofline_fraction": nbytes / step_s / GB / copy_gbps,
           "device_step_s": device_s,
           "device_roofline_fraction": nbytes / device_s / GB / copy_gbps if device_s else None}
    if args.sleep_cycle:
        llm.sleep(1)
        llm.wake_up()
        row["after_sleep_tokens_per_s"] = 1 / decode_step_seconds(llm, prompt, steps, device)
    llm.close()
    del llm
    release(device)
    return row


def vocab(path: str) -> int:
    return int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])


def throughput_workload(args: argparse.Namespace, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """`--num-requests` random prompts of `--prompt-lens` tokens and output lengths of `--output-lens`."""
    rng = random.Random(args.seed)
    min_prompt, max_prompt = (int(x) for x in args.prompt_lens.split(","))
    min_output, max_output = (int(x) for x in args.output_lens.split(","))
    prompts = [random_tokens(rng, rng.randint(min_prompt, max_prompt), vocab_size) for _ in range(args.num_requests)]
    return prompts, [rng.randint(min_output, max_output) for _ in range(args.num_requests)]


def bench_throughput(path: str, device: str, args: argparse.Namespace) -> dict:
    from torpor import SamplingParams

    prompts, output_lens = throughput_workload(args, vocab(path))
    llm = engine(path, device, args, max_model_len=max(map(len, prompts)) + max(output_lens),
                 max_num_seqs=min(args.max_num_seqs, args.num_requests),
                 gpu_memory_utilization=args.gpu_memory_utilization)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate(prompts[:8], params[:8])  # warm-up
    sync(device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    sync(device)
    engine_s = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    if num_tokens != sum(output_lens):
        raise RuntimeError(f"the engine produced {num_tokens} tokens, not the {sum(output_lens)} asked for")
    row = {"output_tokens": num_tokens, "engine_s": engine_s, "engine_tokens_per_s": num_tokens / engine_s}
    llm.close()
    del llm, outputs
    release(device)
    if not args.no_hf:
        progress("the same requests through transformers")
        hf_s = hf_generate_seconds(path, prompts, output_lens, args.hf_batch_size, device)
        if hf_s is not None:
            row.update(hf_s=hf_s, hf_tokens_per_s=num_tokens / hf_s, ratio=hf_s / engine_s)
    return row


def hf_generate_seconds(path: str, prompts: list[list[int]], output_lens: list[int], batch_size: int,
                        device: str) -> float | None:
    """Wall time of transformers' greedy `generate` over the workload (None if it is not installed)."""
    try:  # an optional dependency (the test extra)
        from transformers import AutoModelForCausalLM
    except ImportError:
        print("transformers is not installed: no baseline")
        return None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = model.to(device=device, dtype=torch.bfloat16).eval()  # bf16 whatever the version's dtype kwarg
    model.generation_config.eos_token_id = None  # like ignore_eos: every row runs to max_new_tokens
    pad = 0

    def generate(model, batch: list[list[int]], max_new_tokens: int) -> None:
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                           pad_token_id=pad)

    generate(model, prompts[:2], 4)  # warm-up
    sync(device)
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        generate(model, prompts[first : first + batch_size], max(output_lens[first : first + batch_size]))
    sync(device)
    seconds = time.perf_counter() - start
    del model
    release(device)
    return seconds


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def report(run_: Run, r: dict, args: argparse.Namespace) -> None:
    out = console()
    tp = args.tensor_parallel_size
    models = (*(row["model"] for row in r["batch1"]), r.get("throughput", {}).get("model", ""))
    note = run_.goal_note(("qwen3-8b", "qwen3-0.6b"), ran=models)
    out.print(f"{run_.gpu}: device-to-device copy {fmt_rate(r['copy_gbps'] * GB)} (read + write), the roofline "
              "below" + (f"; {note}" if note else ""))
    rows = []
    for row in r["batch1"]:
        after = row.get("after_sleep_tokens_per_s")
        rows.append([row["model"], f"{row['tokens_per_s']:.1f}", fmt_s(row["step_s"]), fmt_s(row["device_step_s"]),
                     fmt_bytes(row["bytes_per_step"]), fmt_rate(row["gbps"] * GB),
                     fmt_pct(row["roofline_fraction"], 1), fmt_pct(row["device_roofline_fraction"], 1),
                     f"{after:.1f} ({after / row['tokens_per_s'] - 1:+.1%})" if after else "",
                     run_.goal(">= 70% of the roofline", model=row["model"])])
    out.print(table(f"batch-1 greedy decode (TP={tp}, {args.prompt_len}-token prompt, {args.decode_tokens} steps)",
                    ["model", "tokens/s", "per step", "device per step", "bytes per step", "read rate",
                     "of roofline", "device's", "tokens/s after a sleep", "goal"], rows,
                    caption="per step: wall time of generate, prefill excluded; device: its busy time per step "
                            "(torch's profiler, rank 0); bytes: the weights a step reads and the KV cache so far"
                            + ("" if tp == 1 else ", per rank")))
    if "throughput" in r:
        t = r["throughput"]
        rows = [["torpor", fmt_s(t["engine_s"]), f"{t['engine_tokens_per_s']:.0f}", ""]]
        if "hf_s" in t:
            rows.append([f"transformers (batches of {args.hf_batch_size})", fmt_s(t["hf_s"]),
                         f"{t['hf_tokens_per_s']:.0f}", ""])
            rows.append(["torpor against transformers", "", f"{t['ratio']:.1f}x",
                         run_.goal(">= 10x", ("qwen3-0.6b",), model=t["model"])])
        out.print(table(f"{t['model']} throughput: {args.num_requests} requests, {t['output_tokens']} output tokens "
                        f"(TP={tp})", ["engine", "seconds", "output tokens/s", "goal"], rows))
