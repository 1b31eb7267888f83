"""Sampler step time per batch size at Qwen3's vocabulary: the fast path (no sampling options) against the bare
argmax every sampler does, and the cost of the options (penalties read the token history); the memory of the
token history against dense [max_num_seqs, vocab] count tensors.

`--compare`: the current sampler against the old one (tests/references.py: a full-vocabulary int64 cumsum per
draw, four host copies for logprobs) in the same run, per case (GRPO: temperature 1, seeded, no filters; with
logprobs 0 / 1; greedy; ...): milliseconds per call side by side, and whether tokens and logprobs are bit-identical
over `--compare-steps` steps. `--profile` adds each side's kernels (CUDA) or operators (CPU) per call;
`--kernel-blocks` times the draw alone (CUDA: the Triton kernels per block size against the old cumsum).

    python scripts/bench_sampler.py [--device cuda] [--batch-sizes 1 32 256] [--context 1024]
    python scripts/bench_sampler.py --compare [--compare-batch-sizes 512] [--profile] [--kernel-blocks 1024 2048]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from torpor.engine.sampler import _PROB_SCALE, Sampler, _search_dense
from torpor.engine.sampling_params import SamplingParams
from torpor.engine.sequence import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from references import ReferenceSampler
from sampler_checks import assert_same_outputs

VOCAB = 151936
EOS = (151643, 151645)
CASES = {
    "greedy (fast path)": dict(temperature=0.0),
    "top_p 0.9 (fast path)": dict(temperature=0.8, top_p=0.9),
    "greedy + penalties": dict(temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5),
    "every option": dict(temperature=0.8, top_p=0.9, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.5,
                         presence_penalty=0.5, logit_bias={5: 1.0, 6: -1.0}, min_tokens=4096),
}


# Old against new: the workload that matters first (RL rollouts: seeded, temperature 1, no filters).
COMPARE_CASES = {
    "grpo (t=1, seeded)": dict(temperature=1.0),
    "grpo + logprobs=0": dict(temperature=1.0, logprobs=0),
    "grpo + logprobs=1": dict(temperature=1.0, logprobs=1),
    "greedy": dict(temperature=0.0),
    "greedy + logprobs=1": dict(temperature=0.0, logprobs=1),
    "t=0.7": dict(temperature=0.7),
    "min_p 0.05": dict(temperature=1.0, min_p=0.05),
    "top_p 0.9": dict(temperature=1.0, top_p=0.9),
}


CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
clock = CLOCKS["wall"]  # --clock process: CPU time of every thread (CPU runs on a machine shared with others)


def timed(fn, device: torch.device, iterations: int) -> float:
    """Median milliseconds of `fn` (which ends in a host sync) over `iterations` after 3 warm-ups."""
    times = []
    for i in range(iterations + 3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = clock()
        fn()
        if i >= 3:
            times.append((clock() - start) * 1e3)
    return statistics.median(times)


def timed_pair(old, new, device: torch.device, iterations: int) -> tuple[float, float, float]:
    """Median ms of `old` and of `new` (each ends in a host sync), called in turns (which goes first
    alternates), after one warm-up each; and the median of the per-turn ratios old / new, which a load
    that drifts during the run (a shared CPU machine) disturbs least."""
    old(), new()
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(iterations):
        for side in (0, 1) if i % 2 else (1, 0):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = clock()
            (old, new)[side]()
            times[side].append((clock() - start) * 1e3)
    ratios = [a / b for a, b in zip(*times, strict=True)]
    return statistics.median(times[0]), statistics.median(times[1]), statistics.median(ratios)


def seqs_for(batch: int, options: dict) -> list[Sequence]:
    return [Sequence(str(i), [1, 2, 3], SamplingParams(seed=i, max_tokens=8192, **options)) for i in range(batch)]


def profile_calls(fn, device: torch.device, calls: int, top: int) -> str:
    """The `top` kernels (CUDA) or operators (CPU) of `calls` calls of `fn` by self time, per call."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()

    def self_us(event) -> float:
        if device.type != "cuda":
            return event.self_cpu_time_total
        return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)

    events = sorted((e for e in prof.key_averages() if self_us(e) > 0), key=self_us, reverse=True)
    total = sum(self_us(e) for e in events) / calls / 1e3
    lines = [f"      {'device' if device.type == 'cuda' else 'operator'} time {total:.3f} ms per call:"]
    lines += [f"      {self_us(e) / calls / 1e3:8.3f} ms {e.count / calls:5.1f} x  {e.key[:80]}" for e in events[:top]]
    return "\n".join(lines)


def compare(args: argparse.Namespace, device: torch.device) -> None:
    """Old against new per case: ms per call (medians, calls in turns), speed-up (median ratio of the turns),
    bit-identical outputs."""
    print(f"\nold (full int64 cumsum, tests/references.py) against new sampler, vocab {VOCAB}, median of "
          f"{args.iterations} calls ({args.clock} clock, {torch.get_num_threads()} threads); exact = tokens and "
          f"logprobs bit-identical over {args.compare_steps} steps of random logits")
    gen = torch.Generator(device).manual_seed(0)
    for batch in args.compare_batch_sizes:
        print(f"{'batch ' + str(batch):>28} | {'old ms':>9} | {'new ms':>9} | {'speed-up':>8} | exact")
        steps = [torch.randn(batch, VOCAB, device=device, generator=gen) * 4 for _ in range(args.compare_steps)]
        for name, options in COMPARE_CASES.items():
            if args.cases and not any(word in name for word in args.cases):
                continue
            new, old = Sampler(batch, device), ReferenceSampler(batch, device)
            exact = True
            new_seqs, old_seqs = seqs_for(batch, options), seqs_for(batch, options)
            for logits in steps:
                a, b = new(logits, new_seqs), old(logits, old_seqs)
                try:
                    assert_same_outputs(a, b, name)
                except AssertionError as e:
                    exact = False
                    print(f"  MISMATCH {e}")
                for seqs_, out in ((new_seqs, a), (old_seqs, b)):
                    for seq, token in zip(seqs_, out.token_ids, strict=True):
                        seq.append_token(token)
            logits = steps[0]
            t_old, t_new, ratio = timed_pair(lambda s=old, q=old_seqs, x=logits: s(x, q),
                                             lambda s=new, q=new_seqs, x=logits: s(x, q), device, args.iterations)
            print(f"{name:>28} | {t_old:9.3f} | {t_new:9.3f} | {ratio:7.2f}x | {'yes' if exact else 'NO'}")
            if args.profile:
                for side, sampler, seqs in (("old", old, old_seqs), ("new", new, new_seqs)):
                    print(f"    {side}:")
                    print(profile_calls(lambda s=sampler, q=seqs, x=logits: s(x, q), device, 5, args.profile_top))


def kernel_blocks(args: argparse.Namespace, device: torch.device) -> None:
    """The draw alone on the same probabilities: the old quantize + cumsum + searchsorted against the Triton
    kernels per block size (CUDA), with the tokens compared."""
    from torpor.engine import sampler_kernels

    gen = torch.Generator(device).manual_seed(1)
    for batch in args.compare_batch_sizes:
        probs = torch.softmax(torch.randn(batch, VOCAB, device=device, generator=gen) * 4, -1)
        bits = torch.randint(0, 2**52, (batch,), device=device, generator=gen)
        bits_f64 = bits.double()  # the sampler's input row: float64
        expected = _search_dense((probs * _PROB_SCALE).long(), bits)
        old = timed(lambda p=probs, b=bits: _search_dense((p * _PROB_SCALE).long(), b).tolist(), device,
                    args.iterations)
        row = [f"the draw alone, batch {batch}: old {old:.3f} ms"]
        for block in args.kernel_blocks:
            tokens = sampler_kernels.inverse_cdf(probs, bits_f64, block)
            same = "" if torch.equal(tokens, expected) else " MISMATCH"
            ms = timed(lambda p=probs, r=bits_f64, b=block: sampler_kernels.inverse_cdf(p, r, b).tolist(),
                       device, args.iterations)
            row.append(f"block {block}: {ms:.3f} ms{same}")
        print("; ".join(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 32, 256])
    parser.add_argument("--context", type=int, default=1024, help="tokens per sequence (prompt + output so far)")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--compare", action="store_true", help="the old sampler against the new, per case")
    parser.add_argument("--compare-batch-sizes", type=int, nargs="+", default=[512])
    parser.add_argument("--compare-steps", type=int, default=3, help="steps checked bit for bit per case")
    parser.add_argument("--cases", nargs="*", default=[], help="with --compare: only cases whose name has a word")
    parser.add_argument("--profile", action="store_true", help="with --compare: kernels/operators per call")
    parser.add_argument("--profile-top", type=int, default=12)
    parser.add_argument("--kernel-blocks", type=int, nargs="*", default=[],
                        help="CUDA: time the Triton draw alone at these block sizes against the old cumsum")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="process: CPU time of all threads, for a loaded CPU machine (not for CUDA)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    device = torch.device(args.device)
    global clock
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}, triton {triton_version}")
    if args.compare:
        compare(args, device)
    if args.kernel_blocks and device.type == "cuda":
        kernel_blocks(args, device)
    if not args.batch_sizes:
        return
    max_model_len = args.context + 1
    print(f"vocab {VOCAB}, context {args.context} tokens, median of {args.iterations} steps")
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
