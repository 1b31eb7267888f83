"""Time the Triton paged decode attention kernel against the device's memory bandwidth.

Decode attention reads every cached K and V byte once per step, so its roofline is the HBM bandwidth,
measured here as a device-to-device copy (read + write bytes / time). For each batch size and context
length the kernel's median time (triton.testing.do_bench, which flushes L2 before each call) gives
the KV bytes read per second and its fraction of that copy bandwidth. The median of a CUDA-graph replay
(no launch overhead, L2 not flushed) is shown beside it.

    python scripts/bench_decode_attention.py                      # qwen3-8b geometry, bf16
    python scripts/bench_decode_attention.py --batch-sizes 1 --context-lens 131072
"""

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench, do_bench_cudagraph

from torpor.engine.attention.triton_decode import alloc_decode_workspace, num_decode_splits, paged_decode_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from references import paged_decode_attention_reference, random_paged_decode_inputs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def copy_bandwidth(num_bytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * num_bytes / (ms * 1e-3)


def bench_one(args: argparse.Namespace, batch: int, context_len: int) -> dict[str, float]:
    dtype = DTYPES[args.dtype]
    inputs = random_paged_decode_inputs(
        [context_len] * batch,
        num_q_heads=args.num_q_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        block_size=args.block_size,
        dtype=dtype,
        device="cuda",
        poison_unused=False,
    )
    max_blocks_per_seq = inputs[3].shape[1]
    workspace = alloc_decode_workspace(
        batch, args.num_q_heads, args.num_kv_heads, args.head_dim, max_blocks_per_seq, args.block_size, "cuda"
    )
    out = torch.empty_like(inputs[0])
    scale = args.head_dim**-0.5

    def step():
        paged_decode_attention(*inputs, scale, out, workspace=workspace)

    step()
    if batch * context_len <= 1 << 16:  # a cheap sanity check where the reference is quick
        ref = paged_decode_attention_reference(*inputs, scale)
        error = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert error < 2e-2, f"relative error {error:.2e} against the reference"
    kv_bytes = 2 * batch * context_len * args.num_kv_heads * args.head_dim * dtype.itemsize
    ms = do_bench(step, return_mode="median")
    graph_ms = do_bench_cudagraph(step, return_mode="median")
    splits = num_decode_splits(batch, args.num_kv_heads, max_blocks_per_seq, args.block_size, out.device)
    return {"splits": splits, "us": ms * 1e3, "graph_us": graph_ms * 1e3, "gbps": kv_bytes / (ms * 1e-3) / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context-lens", type=int, nargs="+", default=[512, 4096, 32768])
    parser.add_argument("--num-q-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_attention needs a CUDA device")

    roofline = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {roofline / 1e9:.0f} GB/s (read + write)")
    print(
        f"q heads {args.num_q_heads}, kv heads {args.num_kv_heads}, head_dim {args.head_dim}, "
        f"block_size {args.block_size}, {args.dtype}"
    )
    print(f"{'batch':>6} {'context':>8} {'splits':>6} {'median us':>10} {'graph us':>9} {'KV GB/s':>8} {'roofline':>9}")
    for batch in args.batch_sizes:
        for context_len in args.context_lens:
            r = bench_one(args, batch, context_len)
            print(
                f"{batch:>6} {context_len:>8} {r['splits']:>6} {r['us']:>10.1f} {r['graph_us']:>9.1f} "
                f"{r['gbps']:>8.0f} {r['gbps'] * 1e9 / roofline:>9.0%}"
            )
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
