"""Mixture-of-experts figures on a real geometry without its checkpoint: one engine on dummy weights (drawn on the
device from the seed; `torpor make-model PRESET --config-only` writes the config and tokenizer), so the 61 GB of
Qwen3-30B-A3B need no disk. Measured in one run, each beside the bound it is judged against:

- the device's copy bandwidth (a 2 GiB device-to-device copy: bytes read + written / seconds), the bound below;
- batch-1 decode: seconds per token ((a run of N tokens - the same prompt's run of 1) / (N - 1)) against the
  active-parameter roofline (the bytes one token reads: every dense tensor, the lm_head, and top_k of
  num_experts experts per layer; / the copy bandwidth);
- the GRPO workload (`--prompts` prompts x n = `--n` samples, seeded, temperature 1) with prefix caching on and
  off: output tokens/s, and the seconds per decode step ((the run - its first-token run) / (output tokens - 1))
  against reading every weight and the mean KV cache in use once per step;
- level-1 sleep and wake: seconds and GB/s, device memory asleep over the bare context (measured before the
  engine started), answers bit-identical after the wake;
- weights in by name (the trainer's per-expert Hugging Face names, SGLang's and a checkpoint's), in process:
  `update_weights` and `update_weights_from_tensor` in flattened buckets of `--bucket-mb` (built in a ring of
  two), seconds and GB/s. (The source tensors share one buffer per shape: the 61 GB could not be held twice.)

    python scripts/bench_moe.py --preset qwen3-30b-a3b --json moe.json      # an H200
    python scripts/bench_moe.py --preset tiny-moe --device cpu               # a smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from torpor import LLM, SamplingParams
from torpor.engine.models import ModelConfig
from torpor.engine.weights.manifest import weight_specs
from torpor.rl import bucket_named_tensors
from torpor.rl.bucket_ring import BucketRing
from torpor.synthetic import make_model

GB = 1e9


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None, help="a MoE preset (default: qwen3-30b-a3b on a GPU, tiny-moe on CPU)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None, help="bfloat16 (GPU default) or float32 (CPU default)")
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    p.add_argument("--bucket-mb", type=float, default=512)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.preset = args.preset or ("qwen3-30b-a3b" if args.device.startswith("cuda") else "tiny-moe")
    return args


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(device: str, fn) -> tuple[float, object]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def copy_bandwidth(device: str, repeat: int) -> float:
    """GB/s of a device-to-device copy of 2 GiB (256 MiB on CPU): bytes read plus bytes written per second."""
    nbytes = (2 << 30) if device.startswith("cuda") else (256 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = statistics.median(timed(device, lambda: dst.copy_(src))[0] for _ in range(max(3, repeat)))
    return 2 * nbytes / seconds / GB


def device_used(device: str) -> int:
    if not device.startswith("cuda"):
        return 0
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return total - free


def geometry(config: ModelConfig, dtype_bytes: int) -> dict:
    """Bytes of every weight, of what one decoded token reads, and of one token's KV."""
    specs = weight_specs(config)
    expert = sum(_numel(s) for n, s in specs if ".mlp.experts." in n) * dtype_bytes
    total = sum(_numel(s) for _, s in specs) * dtype_bytes
    embed = config.vocab_size * config.hidden_size * dtype_bytes  # one row read per token (the lm_head: all)
    dense = total - expert - (0 if config.tie_word_embeddings else embed)
    active = dense + expert * config.num_experts_per_tok / config.num_experts
    kv = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * dtype_bytes
    return {"weight_bytes": total, "expert_bytes": expert, "active_bytes_per_token": active, "kv_bytes_per_token": kv,
            "num_tensors": len(specs)}


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def prompts_of(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab - 10, (length,), generator=g).tolist() for _ in range(count)]


def decode_batch1(llm: LLM, args: argparse.Namespace, vocab: int) -> dict:
    prompt = prompts_of(1, 32, vocab, 1)
    greedy = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompt, greedy, use_tqdm=False)  # warm-up
    full = statistics.median(timed(args.device, lambda: llm.generate(prompt, greedy, use_tqdm=False))[0]
                             for _ in range(args.repeat))
    one = statistics.median(timed(args.device, lambda: llm.generate(prompt, first, use_tqdm=False))[0]
                            for _ in range(args.repeat))
    per_token = (full - one) / (args.decode_tokens - 1)
    return {"seconds_per_token": per_token, "tokens_per_s": 1 / per_token}


def grpo(llm: LLM, args: argparse.Namespace, vocab: int) -> dict:
    prompts = prompts_of(args.prompts, args.prompt_len, vocab, 2)
    params = SamplingParams(n=args.n, temperature=1.0, seed=7, max_tokens=args.output_len, ignore_eos=True)
    first = SamplingParams(n=args.n, temperature=1.0, seed=7, max_tokens=1, ignore_eos=True)
    llm.generate(prompts[:2], first, use_tqdm=False)  # warm-up
    one, _ = timed(args.device, lambda: llm.generate(prompts, first, use_tqdm=False))
    full, outputs = timed(args.device, lambda: llm.generate(prompts, params, use_tqdm=False))
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"seconds": full, "first_token_seconds": one, "output_tokens": tokens, "tokens_per_s": tokens / full,
            "seconds_per_decode_step": (full - one) / (args.output_len - 1)}


def named_weights(config: ModelConfig, device: str, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor by name, all those of one shape sharing one random buffer (norms: ones)."""
    pool: dict[tuple, torch.Tensor] = {}
    named = []
    for name, shape in weight_specs(config):
        key = (tuple(shape), name.endswith("norm.weight"))
        if key not in pool:
            pool[key] = (torch.ones(shape, dtype=dtype, device=device) if key[1] else
                         torch.randn(shape, dtype=torch.float32, device=device).mul_(shape[-1] ** -0.5).to(dtype))
        named.append((name, pool[key]))
    return named


def weights_in(llm: LLM, config: ModelConfig, dtype: torch.dtype, args: argparse.Namespace) -> dict:
    """Every checkpoint tensor by name into the engine: `update_weights`, then flattened buckets."""
    named = named_weights(config, args.device, dtype)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    size = max(1, int(args.bucket_mb * 2**20))
    ring = BucketRing(2, size)

    def buckets() -> None:
        for bucket in bucket_named_tensors(named, size, ring):
            llm.update_weights_from_tensor(bucket.payload(), load_format="flattened_bucket")

    updates, bucketed = [], []
    for _ in range(args.repeat + 1):  # the first of each: a warm-up
        updates.append(timed(args.device, lambda: llm.update_weights(named))[0])
        bucketed.append(timed(args.device, buckets)[0])
    push = {"bytes": nbytes, "tensors": len(named), "update_weights_s": statistics.median(updates[1:]),
            "update_weights_from_tensor_s": statistics.median(bucketed[1:])}
    push.update(update_weights_gbps=nbytes / push["update_weights_s"] / GB,
                update_weights_from_tensor_gbps=nbytes / push["update_weights_from_tensor_s"] / GB)
    print(f"weights in by name ({len(named):,} tensors, {nbytes / GB:.1f} GB): update_weights "
          f"{push['update_weights_s']:.3f} s ({push['update_weights_gbps']:.0f} GB/s), flattened buckets of "
          f"{args.bucket_mb:g} MiB {push['update_weights_from_tensor_s']:.3f} s "
          f"({push['update_weights_from_tensor_gbps']:.0f} GB/s)", flush=True)
    return push


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    torch.zeros(1, device=device)  # the context, alone
    bare = device_used(device)
    results: dict = {"preset": args.preset, "device": torch.cuda.get_device_name(device) if device != "cpu" else "cpu",
                     "torch": torch.__version__}
    on_target = device.startswith("cuda") and args.preset == "qwen3-30b-a3b"

    def goal(text: str) -> str:  # the goals are for the 30B geometry on a GPU
        return f"(goal {text})" if on_target else "(smoke run: no goal)"

    bandwidth = copy_bandwidth(device, args.repeat)
    results["copy_gbps"] = bandwidth
    print(f"device copy bandwidth: {bandwidth:.0f} GB/s (read + written)", flush=True)
    with tempfile.TemporaryDirectory(prefix="torpor-moe-") as tmp:
        path = str(make_model(args.preset, Path(tmp) / args.preset, dtype=args.dtype, config_only=True,
                              progress=False))
        options = dict(device=device, dtype=args.dtype, load_format="dummy",
                       max_model_len=args.prompt_len + args.output_len + 1, max_num_seqs=args.prompts * args.n,
                       gpu_memory_utilization=args.gpu_memory_utilization)
        start = time.perf_counter()
        llm = LLM(path, **options)
        results["start_s"] = time.perf_counter() - start
        config = llm.engine.model_config
        dtype = getattr(torch, args.dtype)
        shape = geometry(config, torch.empty((), dtype=dtype).element_size())
        results["geometry"] = shape
        print(f"{args.preset}: {shape['weight_bytes'] / GB:.1f} GB of weights in {shape['num_tensors']} checkpoint "
              f"tensors, {shape['active_bytes_per_token'] / GB:.2f} GB read per decoded token; engine up in "
              f"{results['start_s']:.1f} s", flush=True)

        decode = decode_batch1(llm, args, config.vocab_size)
        roofline = bandwidth * GB / shape["active_bytes_per_token"]
        decode.update(roofline_tokens_per_s=roofline, fraction=decode["tokens_per_s"] / roofline)
        results["decode_batch1"] = decode
        print(f"batch-1 decode: {decode['tokens_per_s']:.1f} tokens/s ({decode['seconds_per_token'] * 1e3:.2f} ms), "
              f"active-parameter roofline {roofline:.1f} tokens/s: {decode['fraction']:.0%} {goal('>= 70%')}",
              flush=True)

        on = grpo(llm, args, config.vocab_size)
        results["grpo_caching_on"] = on
        print(f"GRPO, prefix caching on: {on['tokens_per_s']:,.0f} output tokens/s ({on['seconds']:.2f} s)", flush=True)

        check = prompts_of(8, 24, config.vocab_size, 3)
        greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
        before = [(list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)])
                  for o in llm.generate(check, greedy, use_tqdm=False) for c in o.outputs]
        reservation = llm.memory_usage().get("host_reservation") or {}
        while reservation and not reservation.get("done"):  # the host copy's pinning, off the timed sleep
            time.sleep(0.2)
            reservation = llm.memory_usage().get("host_reservation") or {}
        sleep_s, report = timed(device, lambda: llm.sleep(1))
        asleep = device_used(device) - bare
        wake_s, woke = timed(device, lambda: llm.wake_up())
        after = [(list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)])
                 for o in llm.generate(check, greedy, use_tqdm=False) for c in o.outputs]
        results["sleep"] = {"sleep_s": sleep_s, "sleep_gbps": report.bytes_copied / sleep_s / GB,
                            "bytes_copied": report.bytes_copied, "wake_s": wake_s,
                            "wake_gbps": woke.report.bytes_copied / wake_s / GB, "asleep_over_bare_bytes": asleep,
                            "bit_identical_after_wake": before == after}
        s = results["sleep"]
        print(f"level-1 sleep {s['sleep_s']:.3f} s ({s['sleep_gbps']:.1f} GB/s), wake {s['wake_s']:.3f} s "
              f"({s['wake_gbps']:.1f} GB/s) of {s['bytes_copied'] / GB:.1f} GB; asleep {asleep / 2**20:.0f} MiB over "
              f"the bare context; answers after the wake bit-identical: {before == after}", flush=True)

        results["weights_in"] = weights_in(llm, config, dtype, args)
        llm.close()
        del llm
        gc.collect()  # the engine's reference cycles: its memory goes back only when they are collected
        if device.startswith("cuda"):
            torch.cuda.empty_cache()

        llm = LLM(path, enable_prefix_caching=False, **options)
        off = grpo(llm, args, config.vocab_size)
        results["grpo_caching_off"] = off
        llm.close()
    kv_tokens = args.prompts * args.prompt_len + args.prompts * args.n * args.output_len / 2  # mean in use, shared
    kv_mean = kv_tokens * shape["kv_bytes_per_token"]
    floor = (shape["weight_bytes"] + kv_mean) / (bandwidth * GB)
    for label, run in (("on", on), ("off", off)):
        run.update(step_floor_s=floor, step_over_floor=run["seconds_per_decode_step"] / floor)
        print(f"GRPO {args.prompts} prompts x n={args.n}, {args.prompt_len} + {args.output_len} tokens, prefix caching "
              f"{label}: {run['tokens_per_s']:,.0f} output tokens/s ({run['seconds']:.2f} s); a decode step "
              f"{run['seconds_per_decode_step'] * 1e3:.1f} ms, {run['step_over_floor']:.2f}x reading every weight and "
              f"the mean KV once ({floor * 1e3:.1f} ms) {goal('<= 2x')}", flush=True)
    print(f"prefix caching on / off: {on['tokens_per_s'] / off['tokens_per_s']:.2f}x", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0 if results["sleep"]["bit_identical_after_wake"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
