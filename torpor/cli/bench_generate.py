"""`torpor bench generate`: a GRPO-shaped rollout (many prompts, n sampled completions each, seeded) with and
without prefix caching, against Hugging Face transformers' `generate(num_return_sequences=n)` in the same run.

Default workload: 64 prompts of 512 random tokens, n = 8, 256 output tokens each (ignore_eos), seeded sampling
at temperature 1. Output tokens/s of the engine with prefix caching (the prompt prefilled once per request, its
blocks shared by the n samples) and without it (every sample prefills its prompt, as vLLM does with caching
off), and transformers on the same checkpoint, dtype and device (`--hf-prompts` prompts, `--hf-batch-size`
prompts per `generate` call; its tokens/s does not depend on how many batches run, so a subset keeps the run
short). Per engine run also the wall time per decode step against the device's busy time per step: each is
(a run of the workload - the same run stopped after its first token) / the decode steps between (the device's
from torch's profiler over 16 steps); the difference is what the device waits for the host.
"""

from __future__ import annotations

import argparse
import math
import random
import time

from torpor.cli.bench_common import (
    Run,
    add_json_option,
    check_json_path,
    console,
    fmt_s,
    profiled,
    progress,
    release,
    resolve_device,
    resolve_model,
    sync,
    table,
    top_kernels,
    vocab_size,
    write_json,
)

PROFILED_STEPS = 16  # decode steps whose device time is measured


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="n samples per prompt (GRPO-shaped): prefix caching on/off vs transformers",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a preset or a checkpoint folder (default: qwen3-0.6b on a GPU, "
                                                 "tiny on CPU)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--cache-dir", default=None, help="where presets are generated (default: $TORPOR_CACHE/models)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--n", type=int, default=8, help="completions per prompt")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--hf-prompts", type=int, default=16, help="prompts timed through transformers (0: skip)")
    p.add_argument("--hf-batch-size", type=int, default=8, help="prompts per transformers generate call")
    p.add_argument("--profile", type=int, default=0, metavar="PROMPTS",
                   help="also profile the engine (caching on) on this many of the prompts, <= 32 output tokens: the "
                        "top kernels (on CPU: operators) by their own time")
    add_json_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    check_json_path(args.json)
    path, label = resolve_model(args.model, device, gpu_default="qwen3-0.6b", cache_dir=args.cache_dir)
    run_ = Run(device, label)
    rng = random.Random(args.seed)
    vocab = vocab_size(path)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    result = {"run": run_.describe(), **{k: getattr(args, k) for k in (
        "num_prompts", "prompt_len", "n", "output_len", "seed", "max_num_seqs")}}
    for caching in (True, False):
        progress(f"the engine, prefix caching {'on' if caching else 'off'}")
        result["cached" if caching else "uncached"] = bench_engine(path, device, prompts, args, caching)
        release(device)
    result["caching_speedup"] = result["cached"]["tokens_per_s"] / result["uncached"]["tokens_per_s"]
    if args.hf_prompts:
        progress(f"transformers, {args.hf_prompts} prompts")
        hf = bench_transformers(path, device, prompts[: args.hf_prompts], args)
        release(device)
        if hf is not None:
            result["transformers"] = hf
            result["vs_transformers"] = result["cached"]["tokens_per_s"] / hf["tokens_per_s"]
    report(run_, result, args)
    write_json(args.json, result)
    return 0


def bench_engine(path: str, device: str, prompts: list[list[int]], args: argparse.Namespace, caching: bool) -> dict:
    from torpor import LLM, SamplingParams  # (imported when the bench runs, not at `torpor`'s start)

    llm = LLM(path, device=device, max_model_len=args.prompt_len + args.output_len + 1,
              max_num_seqs=args.max_num_seqs, max_n=args.n, gpu_memory_utilization=args.gpu_memory_utilization,
              enable_prefix_caching=caching)

    def workload(max_tokens: int, count: int = len(prompts)) -> list:
        params = [SamplingParams(temperature=1.0, seed=args.seed * 1_000_003 + i, n=args.n, max_tokens=max_tokens,
                                 ignore_eos=True) for i in range(count)]
        llm.reset_prefix_cache()  # every run from an empty cache: the prompts are prefilled each time
        sync(device)
        return llm.generate(prompts[:count], params)

    warm = [[(t + 1) % 1000 for t in prompts[0]]]  # a prompt the workload does not share blocks with
    llm.generate(warm, SamplingParams(temperature=1.0, seed=1, n=args.n, max_tokens=min(8, args.output_len),
                                      ignore_eos=True))
    seconds, outputs = timed(lambda: workload(args.output_len), device)
    num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    if num_tokens != len(prompts) * args.n * args.output_len:
        raise RuntimeError(f"the engine produced {num_tokens} tokens, not {len(prompts) * args.n * args.output_len}")
    row = {"output_tokens": num_tokens, "seconds": seconds, "tokens_per_s": num_tokens / seconds,
           "cached_prompt_tokens": sum(o.num_cached_tokens for o in outputs)}
    # One decode step per output token of every sample when they all fit in one batch, more when not.
    rounds = math.ceil(len(prompts) * args.n / args.max_num_seqs)
    if args.output_len > 1:
        first_s = min(timed(lambda: workload(1), device)[0] for _ in range(2))
        steps, device_s = min(PROFILED_STEPS, args.output_len - 1), None
        if device.startswith("cuda"):
            busy = [profiled(lambda n=n: workload(n), device)[1] for n in (1, 1 + steps)]
            device_s = (busy[1] - busy[0]) / (steps * rounds)
        row["decode_steps"] = {"steps": (args.output_len - 1) * rounds,
                               "wall_s": (seconds - first_s) / ((args.output_len - 1) * rounds),
                               "device_s": device_s, "first_token_s": first_s}
    if caching and args.profile:
        _, _, prof = profiled(lambda: workload(min(32, args.output_len), args.profile), device)
        row["profile_top"] = top_kernels(prof, device.startswith("cuda"))
    llm.close()
    return row  # the caller releases the device's cached memory once `llm` is gone


def timed(fn, device: str) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def bench_transformers(path: str, device: str, prompts: list[list[int]], args: argparse.Namespace) -> dict | None:
    """Seeded sampling through `generate(do_sample=True, num_return_sequences=n)` (None without transformers)."""
    import torch

    try:  # an optional dependency (the test extra)
        from transformers import AutoModelForCausalLM
    except ImportError:
        print("transformers is not installed: no baseline")
        return None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = model.to(device=device, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: every row runs to max_new_tokens

    def generate(model, batch: list[list[int]], max_new_tokens: int) -> int:
        ids = torch.tensor(batch, device=device)  # equal lengths: no padding
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 num_return_sequences=args.n, pad_token_id=0)
        return (out.shape[1] - ids.shape[1]) * out.shape[0]

    torch.manual_seed(args.seed)
    generate(model, prompts[:1], 4)  # warm-up
    seconds, num_tokens = timed(lambda: sum(generate(model, prompts[i : i + args.hf_batch_size], args.output_len)
                                            for i in range(0, len(prompts), args.hf_batch_size)), device)
    model.to("meta")  # the weights go now (the closures keep the module alive until return)
    return {"output_tokens": num_tokens, "seconds": seconds, "tokens_per_s": num_tokens / seconds}


def report(run_: Run, r: dict, args: argparse.Namespace) -> None:
    out = console()
    models = ("qwen3-0.6b", "qwen3-8b")
    out.print(run_.header(models))
    out.print(f"{args.num_prompts} prompts x {args.prompt_len} tokens, n = {args.n}, {args.output_len} output tokens "
              "each, seeded sampling")
    rows = []
    for key, label in (("cached", "torpor, prefix caching on"), ("uncached", "torpor, prefix caching off")):
        e = r[key]
        steps = e.get("decode_steps", {})
        wall, busy = steps.get("wall_s"), steps.get("device_s")
        waits = f"{fmt_s(wall - busy)} ({(wall - busy) / wall:.0%})" if wall and busy else ""
        rows.append([label, f"{e['tokens_per_s']:.0f}", fmt_s(e["seconds"]), fmt_s(wall), fmt_s(busy), waits])
    if "transformers" in r:
        hf = r["transformers"]
        rows.append([f"transformers, {args.hf_prompts} prompts in batches of {args.hf_batch_size}",
                     f"{hf['tokens_per_s']:.0f}", fmt_s(hf["seconds"]), "", "", ""])
    out.print(table("output tokens/s", ["run", "tokens/s", "seconds", "wall per decode step",
                                        "device per decode step", "the device waits for the host"], rows,
                    caption="device time: CUDA only (torch's profiler)"))
    ratios = [["prefix caching on against off", f"{r['caching_speedup']:.2f}x", run_.goal(">= 1.5x", models)]]
    if "vs_transformers" in r:
        ratios.append(["caching on against transformers", f"{r['vs_transformers']:.1f}x",
                       run_.goal(">= 20x", models)])
    out.print(table("ratios", ["", "ratio", "goal"], ratios))
    if r["cached"].get("profile_top"):
        out.print(table(f"the top kernels, caching on ({args.profile} prompts, <= 32 output tokens, profiled)",
                        ["kernel" if run_.on_cuda else "operator", "own time", "calls"],
                        [[k["name"], fmt_s(k["s"]), str(k["calls"])] for k in r["cached"]["profile_top"]]))
