"""The engine's host work per decode step, by phase: what the GPU waits for between two steps (the loop is
synchronous: schedule -> inputs -> run -> sample -> postprocess -> outputs). Runs the tiny model on CPU (its
forward is cheap; the host phases do not depend on the model) with a GRPO-shaped batch: `--prompts` prompts
x n = 8 samples, every sample decoding at once. Prints milliseconds per step of each phase.

    python scripts/bench_host_step.py --prompts 64 --output-len 64
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from torpor.engine import LLM, SamplingParams, inputs, llm_engine, sampler, scheduler
from torpor.engine.checkpoint import make_model

PHASES = {  # phase -> (owner, method name)
    "schedule": (scheduler.Scheduler, "schedule"),
    "decode inputs": (inputs.DecodeBuffers, "load"),
    "sampler inputs": (sampler.Sampler, "_load_inputs"),
    "postprocess": (scheduler.Scheduler, "postprocess"),
    "outputs": (llm_engine.LLMEngine, "_outputs"),
}


def timed_phases() -> dict[str, float]:
    """Wrap each phase's method to add up its seconds; returns the totals (filled as the engine runs)."""
    totals: dict[str, float] = defaultdict(float)
    for phase, (owner, name) in PHASES.items():
        method = getattr(owner, name)

        def wrapper(*args, _method=method, _phase=phase, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                totals[_phase] += time.perf_counter() - start

        setattr(owner, name, wrapper)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    n = 8
    with tempfile.TemporaryDirectory() as folder:
        path = make_model("tiny", Path(folder) / "tiny", dtype="float32", progress=False)
        llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=args.prompt_len + args.output_len + 1,
                  max_num_seqs=args.prompts * n, block_size=16, max_n=n)
        rng = random.Random(0)
        prompts = [[rng.randrange(1000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        params = [SamplingParams(temperature=1.0, seed=i, n=n, max_tokens=args.output_len, ignore_eos=True)
                  for i in range(args.prompts)]
        llm.generate(prompts[:2], params[:2])  # warm-up
        totals = timed_phases()
        start = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - start
    steps = args.output_len
    print(f"{args.prompts} prompts x {n} samples = {args.prompts * n} sequences, {steps} steps, "
          f"{wall / steps * 1e3:.2f} ms per step in all (the tiny model's forward included)")
    for phase, seconds in totals.items():
        print(f"  {phase:15s} {seconds / steps * 1e3:7.3f} ms per step")
    print(f"  {'host, together':15s} {sum(totals.values()) / steps * 1e3:7.3f} ms per step")


if __name__ == "__main__":
    main()
