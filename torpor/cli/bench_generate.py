"""`torpor bench generate`: a GRPO-shaped rollout (many prompts, n sampled completions each, seeded) with
and without prefix caching, against Hugging Face transformers' `generate(num_return_sequences=n)`.

Default workload: 64 prompts of 512 random tokens, n = 8, 256 output tokens each (ignore_eos), seeded
sampling at temperature 1. Output tokens/s of the engine with prefix caching (the prompt prefilled once
per request, its blocks shared by the n samples) and without it (every sample prefills its prompt, as
vLLM does with caching off), the prefix-cache hit rate, and transformers on the same checkpoint, dtype
and device (--hf-prompts prompts, --hf-batch-size prompts per `generate` call; its tokens/s does not
depend on how many batches run, so a subset keeps the run short).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from torpor.cli import units
from torpor.cli.bench_decode import _cache_root, _device_name, _release, _sync, checkpoint

PRESETS = ("qwen3-0.6b", "qwen3-8b", "tiny")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="n samples per prompt (GRPO-shaped): prefix caching on/off vs transformers",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help=f"a preset ({', '.join(PRESETS)}) or a checkpoint folder "
                                                 "(default: qwen3-0.6b on GPU, tiny on CPU)")
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
                        "top kernels by device time and how busy the device was")
    p.add_argument("--json", default=None, help="also write the results here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from torpor.engine.llm import _resolve_device
    from torpor.engine.models import ModelConfig

    device = torch.device(_resolve_device(args.device))
    model = args.model or ("qwen3-0.6b" if device.type == "cuda" else "tiny")
    if model in PRESETS:
        path = checkpoint(model, Path(args.cache_dir or Path(_cache_root()) / "models"))
    else:
        path = Path(model)
    rng = random.Random(args.seed)
    vocab_size = ModelConfig.from_pretrained(path).vocab_size
    prompts = [[rng.randrange(vocab_size) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    print(f"bench generate: {path.name} on {_device_name(device)}: {args.num_prompts} prompts x {args.prompt_len} "
          f"tokens, n={args.n}, {args.output_len} output tokens, seeded sampling")
    result = {"model": str(path), "device": _device_name(device), **{k: getattr(args, k) for k in (
        "num_prompts", "prompt_len", "n", "output_len", "seed")}}
    on_gpu = device.type == "cuda"
    for caching in (True, False):
        row = bench_engine(path, device, prompts, args, caching)
        result["cached" if caching else "uncached"] = row
        print(f"  engine, prefix caching {'on ' if caching else 'off'}: {units.number(row['tokens_per_s'])} output "
              f"tok/s ({row['output_tokens']} tokens in {units.seconds(row['seconds'])}), prefix-cache hit rate "
              f"{units.percent(row['hit_rate'])}, prompt tokens computed {row['computed_prompt_tokens']}")
        print(f"    {DecodeStepTimer.describe(row['decode_steps'])}")
    result["caching_speedup"] = speedup = result["cached"]["tokens_per_s"] / result["uncached"]["tokens_per_s"]
    print(f"  prefix caching: {units.number(speedup)}x {units.goal('>= 1.5x', speedup >= 1.5, on_gpu)}")
    if args.hf_prompts:
        hf = bench_transformers(path, device, prompts[: args.hf_prompts], args)
        if hf is not None:
            result["transformers"] = hf
            result["vs_transformers"] = ratio = result["cached"]["tokens_per_s"] / hf["tokens_per_s"]
            print(f"  transformers generate(num_return_sequences={args.n}), {args.hf_prompts} prompts in batches "
                  f"of {args.hf_batch_size}: {units.number(hf['tokens_per_s'])} output tok/s "
                  f"({units.seconds(hf['seconds'])}); engine with caching {units.number(ratio)}x "
                  f"{units.goal('>= 20x', ratio >= 20, on_gpu)}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def bench_engine(path: Path, device: torch.device, prompts: list[list[int]], args: argparse.Namespace,
                 caching: bool) -> dict:
    from torpor.engine import LLM, SamplingParams

    llm = LLM(str(path), device=str(device), max_model_len=args.prompt_len + args.output_len + 1,
              max_num_seqs=args.max_num_seqs, max_n=args.n, gpu_memory_utilization=args.gpu_memory_utilization,
              enable_prefix_caching=caching)
    params = [SamplingParams(temperature=1.0, seed=args.seed * 1_000_003 + i, n=args.n, max_tokens=args.output_len,
                             ignore_eos=True) for i in range(len(prompts))]
    warm = [[(t + 1) % 1000 for t in prompts[0]]]  # a prompt the workload does not share blocks with
    llm.generate(warm, SamplingParams(temperature=1.0, seed=1, n=args.n, max_tokens=min(8, args.output_len),
                                      ignore_eos=True), use_tqdm=False)
    llm.reset_prefix_cache()
    before = llm.engine.prefix_cache_stats()
    _sync(device)
    start = time.perf_counter()
    with DecodeStepTimer(llm, device) as timer:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    _sync(device)
    seconds = time.perf_counter() - start
    stats = llm.engine.prefix_cache_stats()
    queries, hits = stats["queries"] - before["queries"], stats["hits"] - before["hits"]
    num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    assert num_tokens == len(prompts) * args.n * args.output_len, "every sample must produce output_len tokens"
    profile = None
    if caching and args.profile:
        llm.reset_prefix_cache()
        profile = profile_generate(llm, prompts[: args.profile], params[: args.profile], device)
    total_prompt = len(prompts) * args.n * args.prompt_len
    row = dict(output_tokens=num_tokens, seconds=seconds, tokens_per_s=num_tokens / seconds,
               hit_rate=hits / queries if queries else 0.0, computed_prompt_tokens=total_prompt - hits,
               num_kv_blocks=llm.config.num_kv_blocks, decode_steps=timer.result(),
               **({"profile": profile} if profile else {}))
    llm.close()
    del llm, outputs
    _release(device)
    return row


class DecodeStepTimer:
    """Wall time per decode step against the device's time per step, without the profiler: while in use, each
    decode step records two CUDA events, one after its inputs are loaded (the GPU is idle then: the previous step
    ended by syncing on its tokens) and one once its tokens are on the host. Their interval is the device's
    work (plus the sampler's launches, which run ahead of it); the wall time from one step's start to the next's,
    less that, is what the GPU waits for the host. One synchronization, in `result`. On CPU: wall time only."""

    def __init__(self, llm, device: torch.device) -> None:
        self.engine, self.on_cuda = llm.engine, device.type == "cuda"
        runner = self.engine.model_runner
        self.runner, self.local = runner, getattr(runner, "local", runner)  # tensor parallel: rank 0's runner
        self.starts: list[float] = []        # perf_counter at the start of every step
        self.decode: list[int] = []          # indices of the decode steps among them
        self.events: list[tuple] = []        # (start, end) CUDA events of each decode step

    def __enter__(self) -> DecodeStepTimer:
        step, run, load = self.engine.step, self.runner.run, self.local.buffers.load

        def timed_step():
            self.starts.append(time.perf_counter())
            return step()

        def timed_load(seqs, batch_size):
            result = load(seqs, batch_size)
            self.decode.append(len(self.starts) - 1)  # only decode steps load the decode buffers
            if self.on_cuda:
                self.events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                self.events[-1][0].record()  # on the engine's stream (the runner's scope is current)
            return result

        def timed_run(seqs, is_prefill):
            result = run(seqs, is_prefill)
            if self.on_cuda and not is_prefill:
                self.events[-1][1].record(self.local.engine_stream.stream)
            return result

        self.engine.step, self.runner.run, self.local.buffers.load = timed_step, timed_run, timed_load
        return self

    def __exit__(self, *exc) -> None:
        for obj, name in ((self.engine, "step"), (self.runner, "run"), (self.local.buffers, "load")):
            delattr(obj, name)  # the instance attribute goes: the method is back

    def result(self) -> dict:
        """Milliseconds per decode step: `wall_ms` (start to the next step's start), `device_ms` (None on CPU)."""
        periods = [self.starts[i + 1] - self.starts[i] for i in self.decode if i + 1 < len(self.starts)]
        device_ms = None
        if self.on_cuda and self.events:
            torch.cuda.synchronize()
            device_ms = sum(start.elapsed_time(end) for start, end in self.events) / len(self.events)
        return dict(steps=len(self.decode), wall_ms=sum(periods) / len(periods) * 1e3 if periods else None,
                    device_ms=device_ms)

    @staticmethod
    def describe(steps: dict) -> str:
        wall, device = steps["wall_ms"], steps["device_ms"]
        if wall is None:
            return "decode steps: none timed"
        if device is None:
            return (f"decode steps: {units.seconds(wall / 1e3)} wall per step ({steps['steps']} steps; device time "
                    "needs CUDA)")
        waits = units.seconds((wall - device) / 1e3)
        return (f"decode steps: {units.seconds(wall / 1e3)} wall per step, {units.seconds(device / 1e3)} on the "
                f"device (CUDA events, {steps['steps']} steps): the device waits {waits} per step for the host "
                f"({units.percent((wall - device) / wall)})")


def profile_generate(llm, prompts: list[list[int]], params: list, device: torch.device, top: int = 20) -> dict:
    """`generate` of `prompts` (at most 32 output tokens each) under torch.profiler: the `top` kernels (or, on
    CPU, operators) by device time, and the device's busy time against the wall time (the rest is the host)."""
    from torch.profiler import ProfilerActivity, profile

    from torpor.engine import SamplingParams

    short = [SamplingParams(temperature=p.temperature, seed=p.seed, n=p.n, max_tokens=min(32, p.max_tokens),
                            ignore_eos=True) for p in params]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        llm.generate(prompts, short, use_tqdm=False)
        _sync(device)
    wall = time.perf_counter() - start
    on_device = device.type == "cuda"

    def self_us(event) -> float:
        if not on_device:
            return event.self_cpu_time_total
        return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)

    events = [e for e in prof.key_averages() if self_us(e) > 0]
    busy = sum(self_us(e) for e in events) / 1e6
    rows = sorted(events, key=self_us, reverse=True)[:top]
    kernels = [dict(name=e.key[:90], ms=self_us(e) / 1e3, calls=e.count) for e in rows]
    print(f"  profile ({len(prompts)} prompts, {short[0].max_tokens} output tokens, caching on): wall "
          f"{units.seconds(wall)}, {'device busy' if on_device else 'operators'} {units.seconds(busy)} "
          f"({units.percent(busy / wall)}); top by self time:")
    for k in kernels:
        print(f"    {k['ms']:9.2f} ms  {k['calls']:6d} x  {k['name']}")
    return dict(wall_s=wall, busy_s=busy, top=kernels)


def bench_transformers(path: Path, device: torch.device, prompts: list[list[int]], args: argparse.Namespace):
    """Seeded sampling through `generate(do_sample=True, num_return_sequences=n)` (None without transformers)."""
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as transformers_logging
    except ImportError:
        print("transformers is not installed: no baseline")
        return None
    transformers_logging.disable_progress_bar()  # its "Loading weights" bar, amid the results
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = model.to(device=device, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: every row runs to max_new_tokens

    def generate(batch: list[list[int]], max_new_tokens: int) -> int:
        ids = torch.tensor(batch, device=device)  # equal lengths: no padding
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 num_return_sequences=args.n, pad_token_id=0)
        return (out.shape[1] - ids.shape[1]) * out.shape[0]

    torch.manual_seed(args.seed)
    generate(prompts[:1], 4)  # warm-up
    _sync(device)
    start = time.perf_counter()
    num_tokens = sum(generate(prompts[i : i + args.hf_batch_size], args.output_len)
                     for i in range(0, len(prompts), args.hf_batch_size))
    _sync(device)
    seconds = time.perf_counter() - start
    model.to("meta")  # the weights go now (the closure keeps the module alive until return)
    _release(device)
    return dict(output_tokens=num_tokens, seconds=seconds, tokens_per_s=num_tokens / seconds)
