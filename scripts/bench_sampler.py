"""Sampler step time per batch size at Qwen3's vocabulary: the fast path (no sampling options) against the bare
argmax every sampler does, and the cost of the options (penalties read the token history); the memory of the
token history against dense [max_num_seqs, vocab] count tensors.

    python scripts/bench_sampler.py [--device cuda] [--batch-sizes 1 32 256] [--context 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from torpor.engine.sampler import Sampler
from torpor.engine.sampling_params import SamplingParams
from torpor.engine.sequence import Sequence

VOCAB = 151936
EOS = (151643, 151645)
CASES = {
    "greedy (fast path)": dict(temperature=0.0),
    "top_p 0.9 (fast path)": dict(temperature=0.8, top_p=0.9),
    "greedy + penalties": dict(temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5),
    "every option": dict(temperature=0.8, top_p=0.9, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.5,
                         presence_penalty=0.5, logit_bias={5: 1.0, 6: -1.0}, min_tokens=4096),
}


def timed(fn, device: torch.device, iterations: int) -> float:
    """Median milliseconds of `fn` (which ends in a host sync) over `iterations` after 3 warm-ups."""
    times = []
    for i in range(iterations + 3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if i >= 3:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--context", type=int, default=1024, help="tokens per sequence (prompt + output so far)")
    parser.add_argument("--iterations", type=int, default=30)
    args = parser.parse_args()
    device = torch.device(args.device)
    max_model_len = args.context + 1
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"vocab {VOCAB}, context {args.context} tokens, median of {args.iterations} steps")
    print(f"{'batch':>5} | {'bare argmax ms':>14} | " + " | ".join(f"{name:>22}" for name in CASES))
    for batch in args.batch_sizes:
        sampler = Sampler(batch, device, max_model_len, EOS)
        logits = torch.randn(batch, VOCAB, device=device) * 4
        bare = timed(lambda logits=logits: logits.argmax(-1).tolist(), device, args.iterations)
        row = []
        for options in CASES.values():
            g = torch.Generator().manual_seed(0)
            seqs = [Sequence(str(i), torch.randint(0, VOCAB, (args.context,), generator=g).tolist(),
                             SamplingParams(seed=i, max_tokens=8192, **options)) for i in range(batch)]
            sampler(logits, seqs)  # the token history is written once; later steps add what is new (nothing)
            step = lambda seqs=seqs, logits=logits, sampler=sampler: sampler(logits, seqs)  # noqa: E731
            row.append(timed(step, device, args.iterations))
        print(f"{batch:>5} | {bare:>14.3f} | " + " | ".join(f"{ms:>19.3f} ms" for ms in row))
    for num_seqs, model_len in ((256, 4096), (256, 40960), (1024, 8192)):
        history = Sampler.state_bytes(num_seqs, model_len) / 2**20
        dense = num_seqs * VOCAB * 5 / 2**20  # int32 counts + a bool prompt mask
        print(f"sampler state, max_num_seqs {num_seqs}, max_model_len {model_len}: {history:.1f} MiB "
              f"(dense counts would be {dense:.1f} MiB)")


if __name__ == "__main__":
    main()
