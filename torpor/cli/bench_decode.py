"""`torpor bench decode`: decode speed against the memory roofline, and batched throughput against
Hugging Face transformers. Synthetic checkpoints are generated into the cache directory when missing.

1. copy bandwidth: a device-to-device copy; bytes read + bytes written per second (what the memory
   sustains for a streaming kernel).
2. batch 1, per model (--models): greedy decode with CUDA graphs, tokens/s end to end (engine steps),
   and the bytes each step must read -- the weights (the embedding table only where it is also the LM
   head) plus the KV cache so far -- per second, as a fraction of the copy bandwidth. `gpu` repeats the
   same step's graph + LM head without the host, to split kernel time from host overhead.
3. throughput (--throughput-model): --num-requests requests with random prompt and output lengths through
   `LLM.generate`, then through transformers' `generate` (batches of --hf-batch-size, left-padded, same
   checkpoint, dtype and device); output tokens/s of each and the ratio. transformers runs each batch for
   its longest output, so only the tokens requested count for it too.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path

import torch

from torpor.cli import units

GB = 1e9


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("decode", help="decode tokens/s vs the memory roofline, throughput vs transformers",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N (cpu only for smoke tests)")
    p.add_argument("--models", default="qwen3-8b,qwen3-0.6b", help="presets for the batch-1 decode runs")
    p.add_argument("--throughput-model", default="qwen3-0.6b", help="preset for the throughput run ('' skips it)")
    p.add_argument("--cache-dir", default=None, help="where checkpoints are generated (default: $TORPOR_CACHE/models)")
    p.add_argument("--prompt-len", type=int, default=128, help="batch 1: prompt tokens")
    p.add_argument("--decode-tokens", type=int, default=256, help="batch 1: tokens generated and timed")
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
    p.add_argument("--sleep-cycle", action="store_true",
                   help="batch 1: measure again after a level-1 sleep and a full wake (the sleep's effect on speed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: CUDA is not available on this machine (--device cpu runs a smoke "
                         "test)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cache = Path(args.cache_dir) if args.cache_dir else Path(_cache_root()) / "models"
    results: dict = {"device": _device_name(device), "torch": torch.__version__}
    results["copy_gbps"] = copy_bandwidth(device, int(args.copy_gib * 2**30))
    print(f"{results['device']}: device-to-device copy {units.rate(results['copy_gbps'] * GB, 1)} (read + write)")
    results["batch1"] = []
    for preset in [m for m in args.models.split(",") if m]:
        row = bench_batch1(checkpoint(preset, cache), device, args, results["copy_gbps"])
        results["batch1"].append({"model": preset, **row})
        step_s, moved = row["step_ms"] / 1e3, row["bytes_per_step"]
        replay = "" if row["gpu_step_ms"] is None else (
            f"; {'graph replay' if row['cuda_graphs'] else 'eager replay'} without the host: "
            f"{units.seconds(row['gpu_step_ms'] / 1e3)}, {units.percent(row['gpu_roofline_fraction'])}")
        print(f"{preset} batch 1 (TP={args.tensor_parallel_size}): {units.number(row['tokens_per_s'])} tok/s, "
              f"{units.seconds(step_s)} per step reading {units.size(moved)} at {units.rate(moved, step_s)} = "
              f"{units.percent(row['roofline_fraction'])} of the copy bandwidth{replay}")
        if "after_sleep_tokens_per_s" in row:
            print(f"{preset} batch 1 after a level-1 sleep and wake: {units.number(row['after_sleep_tokens_per_s'])} "
                  f"tok/s ({100 * (row['after_sleep_tokens_per_s'] / row['tokens_per_s'] - 1):+.1f}%)")
    if args.throughput_model:
        row = bench_throughput(checkpoint(args.throughput_model, cache), device, args)
        results["throughput"] = {"model": args.throughput_model, **row}
        line = (f"{args.throughput_model} throughput (TP={args.tensor_parallel_size}), {args.num_requests} requests: "
                f"torpor {units.number(row['engine_tokens_per_s'])} tok/s ({units.seconds(row['engine_s'])})")
        if row.get("hf_tokens_per_s"):
            line += (f", transformers {units.number(row['hf_tokens_per_s'])} tok/s ({units.seconds(row['hf_s'])}): "
                     f"{units.number(row['ratio'])}x")
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """GB/s of bytes read + written by `dst.copy_(src)` on the device."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    seconds = time.perf_counter() - start
    del src, dst
    _release(device)
    return 2 * nbytes * repeats / seconds / GB


def checkpoint(preset: str, cache: Path) -> Path:
    """The synthetic bf16 checkpoint of `preset` (seed 0), generated once into `cache` (the one cache
    `torpor demo` uses too)."""
    from torpor.synthetic import cached_model_path

    return cached_model_path(preset, progress=True, models_dir=cache)


def bench_batch1(path: Path, device: torch.device, args: argparse.Namespace, copy_gbps: float) -> dict:
    from torpor.engine import LLM, SamplingParams

    max_model_len = args.prompt_len + args.decode_tokens + 16
    llm = LLM(str(path), device=str(device), max_model_len=max_model_len, max_num_seqs=1,
              num_kv_blocks=-(-max_model_len // 16), block_size=16, tensor_parallel_size=args.tensor_parallel_size)
    engine = llm.engine
    prompt = _random_tokens(random.Random(args.seed), args.prompt_len, engine.vocab_size)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    step_s, num_steps = _decode_step_seconds(engine, prompt, args.decode_tokens, device)
    # decode step k (1..num_steps) attends over prompt_len + k tokens
    bytes_per_step = weight_bytes_read(engine) + kv_bytes_per_token(engine) * (args.prompt_len + (num_steps + 1) / 2)
    row = dict(tokens_per_s=1 / step_s, step_ms=1e3 * step_s, bytes_per_step=bytes_per_step,
               gbps=bytes_per_step / step_s / GB, roofline_fraction=bytes_per_step / step_s / GB / copy_gbps,
               gpu_step_ms=None, gpu_roofline_fraction=None, cuda_graphs=_rank0(engine).graphs is not None)
    if args.tensor_parallel_size == 1:  # a replay on rank 0 alone would wait for the workers' collectives
        gpu_step_s = _gpu_step_seconds(engine, device)
        row.update(gpu_step_ms=1e3 * gpu_step_s, gpu_roofline_fraction=bytes_per_step / gpu_step_s / GB / copy_gbps)
    if args.sleep_cycle:
        llm.sleep(1)
        llm.wake_up()
        row["after_sleep_tokens_per_s"] = 1 / _decode_step_seconds(engine, prompt, args.decode_tokens, device)[0]
    llm.close()
    del llm, engine
    _release(device)
    return row


def _decode_step_seconds(engine, prompt: list[int], num_tokens: int, device: torch.device) -> tuple[float, int]:
    """Seconds per decode step of one greedy request (the prefill step not counted), and the step count."""
    from torpor.engine import SamplingParams

    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True))
    engine.step()  # the prefill and the first token
    _sync(device)
    start = time.perf_counter()
    num_steps = 0
    while not engine.is_finished():
        engine.step()
        num_steps += 1
    _sync(device)
    return (time.perf_counter() - start) / num_steps, num_steps


def weight_bytes_read(engine) -> int:
    """Parameter bytes one decode step reads: all of them, except the embedding table when the LM head
    is separate (a step looks up one row of it)."""
    model = _rank0(engine).model  # under tensor parallelism: rank 0's shard
    total = sum(p.nbytes for p in model.parameters())
    embed = model.model.embed_tokens.weight
    return total if model.lm_head is None else total - embed.nbytes + embed[0].nbytes


def _rank0(engine):
    """The engine's ModelRunner (rank 0's under tensor parallelism)."""
    return getattr(engine.model_runner, "local", engine.model_runner)


def kv_bytes_per_token(engine) -> int:
    kv_cache = _rank0(engine).kv_cache  # [layers, 2, blocks, block_size, kv_heads (rank 0's), head_dim]
    return kv_cache.nbytes // (kv_cache.shape[2] * kv_cache.shape[3])


def _gpu_step_seconds(engine, device: torch.device, repeats: int = 50) -> float:
    """Device time of the last decode step's graph + LM head, replayed without the host in the loop (the
    request is finished: its slot writes land in freed blocks). Falls back to eager off CUDA."""
    from torpor.engine.cuda_graphs import run_decode

    runner = engine.model_runner
    with torch.inference_mode():
        def step() -> None:
            if runner.graphs is not None:
                hidden = runner.graphs.replay(runner.buffers, 1)
            else:
                hidden = run_decode(runner.model, runner.buffers, 1, runner.config.max_model_len)
            runner.model.compute_logits(hidden[:1]).argmax(-1)

        step()
        _sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        _sync(device)
    return (time.perf_counter() - start) / repeats


def throughput_workload(args: argparse.Namespace, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    min_prompt, max_prompt = (int(x) for x in args.prompt_lens.split(","))
    min_output, max_output = (int(x) for x in args.output_lens.split(","))
    prompts = [_random_tokens(rng, rng.randint(min_prompt, max_prompt), vocab_size) for _ in range(args.num_requests)]
    return prompts, [rng.randint(min_output, max_output) for _ in range(args.num_requests)]


def bench_throughput(path: Path, device: torch.device, args: argparse.Namespace) -> dict:
    from torpor.engine import LLM, SamplingParams
    from torpor.engine.models import ModelConfig

    prompts, output_lens = throughput_workload(args, ModelConfig.from_pretrained(path).vocab_size)
    max_model_len = max(map(len, prompts)) + max(output_lens)
    llm = LLM(str(path), device=str(device), max_model_len=max_model_len,
              max_num_seqs=min(args.max_num_seqs, args.num_requests),
              gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tensor_parallel_size)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up
    _sync(device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    _sync(device)
    engine_s = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_tokens == sum(output_lens), "every request must produce exactly its max_tokens"
    row = dict(output_tokens=num_tokens, engine_s=engine_s, engine_tokens_per_s=num_tokens / engine_s,
               num_kv_blocks=llm.config.num_kv_blocks)
    llm.close()
    del llm, outputs
    _release(device)
    if not args.no_hf:
        hf_s = hf_generate_seconds(path, prompts, output_lens, args.hf_batch_size, device)
        if hf_s is not None:
            row.update(hf_s=hf_s, hf_tokens_per_s=num_tokens / hf_s, ratio=hf_s / engine_s)
    return row


def hf_generate_seconds(path: Path, prompts: list[list[int]], output_lens: list[int], batch_size: int,
                        device: torch.device) -> float | None:
    """Wall time of transformers' greedy `generate` over the workload (None if it is not installed)."""
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as transformers_logging
    except ImportError:
        print("transformers is not installed: no baseline")
        return None
    transformers_logging.disable_progress_bar()  # its "Loading weights" bar, amid the results
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
    _sync(device)
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        generate(model, prompts[first : first + batch_size], max(output_lens[first : first + batch_size]))
    _sync(device)
    seconds = time.perf_counter() - start
    del model
    _release(device)
    return seconds


def _random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _cache_root() -> str:
    from torpor.env import Env

    return Env.read().cache_dir
