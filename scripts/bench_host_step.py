"""The engine's host work per decode step, all of it: what the GPU waits for between two steps (the loop is
synchronous: schedule -> inputs -> forward -> sample -> .tolist() -> postprocess -> outputs). Runs the tiny model
on CPU with a GRPO-shaped batch: `--prompts` prompts x n = 8 samples, every sample decoding at once.

Every decode step's wall time is split into phases (milliseconds per decode step, prefill steps left out):

- `LLM.generate`'s loop around `step`, `step` itself around its calls;
- schedule, postprocess, outputs (detokenization, stop strings, snapshots);
- the model runner: decode inputs, the forward pass and the LM head (device work: on CUDA a graph replay and one
  GEMM launch, here the tiny model computed on the CPU), the sampler (its input building, then its operators).

On CPU the sampler's operators compute as they are called; on CUDA they are launches. So its host cost is also
measured apart: the same sampler on [num_seqs, 16] logits (operators of negligible work: what remains is Python
and dispatch, about what a GPU's launches cost). `host, on a GPU` adds that to the Python phases.

On a GPU not all of it makes the device wait: the sampler (its inputs and its launches) runs after the graph
replay and the LM head are launched, so the host does it while the device computes the forward. What the device
waits for, `host, exposed`, is the rest: from the sampled tokens' `.tolist()` to the next replay (postprocess,
outputs, generate's loop, step, schedule, decode inputs, the runner's own code).

    python scripts/bench_host_step.py --prompts 64 --prompt-len 512 --output-len 32
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from torpor.engine import LLM, SamplingParams, cuda_graphs, inputs, llm, llm_engine, model_runner, sampler, scheduler
from torpor.engine.models import llama
from torpor.synthetic import make_model

# phase -> (owner, method name). Inclusive times; `report` takes the nested ones out of their parents.
PHASES = {
    "generate": (llm.LLM, "generate"),
    "step": (llm_engine.LLMEngine, "step"),
    "schedule": (scheduler.Scheduler, "schedule"),
    "run": (model_runner.ModelRunner, "run"),
    "decode inputs": (inputs.DecodeBuffers, "load"),
    "forward": (cuda_graphs, "run_decode"),
    "lm head": (llama.LlamaForCausalLM, "compute_logits"),
    "sampler": (sampler.Sampler, "__call__"),
    "sampler inputs": (sampler.Sampler, "_load_inputs"),
    "postprocess": (scheduler.Scheduler, "postprocess"),
    "outputs": (llm_engine.LLMEngine, "_outputs"),
}
CHILDREN = {  # what each phase's own time excludes
    "generate": ["step"],
    "step": ["schedule", "run", "postprocess", "outputs"],
    "run": ["decode inputs", "forward", "lm head", "sampler"],
    "sampler": ["sampler inputs"],
}
CLOCK = [time.perf_counter]  # or time.thread_time (--clock thread): this thread's CPU seconds
DEVICE = ("forward", "lm head", "sampler ops")  # on a GPU: a graph replay, a GEMM launch, kernel launches


class Recorder:
    """Adds up each phase's seconds per step; keeps decode steps only (the schedule says which)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self.decode: dict[str, float] = defaultdict(float)
        self.num_decode_steps = 0
        self.is_prefill = False
        self.outside = 0.0  # generate's own time, all steps (its loop runs once per step)
        self.num_steps = 0

    def wrap(self) -> None:
        for phase, (owner, name) in PHASES.items():
            setattr(owner, name, self._wrapper(phase, getattr(owner, name)))
        model_runner.run_decode = cuda_graphs.run_decode  # the runner imported it by name

    def _wrapper(self, phase: str, method):
        def wrapper(*args, **kwargs):
            start = CLOCK[0]()
            try:
                result = method(*args, **kwargs)
            finally:
                self.step[phase] += CLOCK[0]() - start
            if phase == "schedule":
                self.is_prefill = result[1]
            elif phase == "step":
                self._end_step()
            return result
        return wrapper

    def _end_step(self) -> None:
        self.num_steps += 1
        step, self.step = self.step, defaultdict(float)
        self.outside -= step["step"]
        if not self.is_prefill:
            self.num_decode_steps += 1
            for phase, seconds in step.items():
                self.decode[phase] += seconds

    def report(self, generate_seconds: float, sampler_host: float) -> dict[str, float]:
        """Milliseconds per decode step, each phase without its children."""
        per_step = {phase: seconds / self.num_decode_steps * 1e3 for phase, seconds in self.decode.items()}
        own = dict(per_step)
        own["generate"] = (generate_seconds + self.outside) / self.num_steps * 1e3  # its loop, per step
        for parent, children in CHILDREN.items():
            if parent != "generate":
                own[parent] = per_step[parent] - sum(per_step.get(c, 0.0) for c in children)
        own["sampler ops"] = own.pop("sampler")
        own["sampler host"] = sampler_host * 1e3
        return own


def sampler_host_seconds(recorder: Recorder, num_seqs: int, repeats: int = 20) -> float:
    """The sampler's seconds per call on [num_seqs, 16] logits, its inputs left out (a phase of their own): its
    Python and operator dispatch, no work. Call after the run (it reads the recorder's open step)."""
    from torpor.engine.sequence import Sequence

    params = SamplingParams(temperature=1.0, seed=0, max_tokens=8, ignore_eos=True)
    seqs = [Sequence(str(i), [1, 2, 3], params) for i in range(num_seqs)]
    for seq in seqs:
        seq.sampling_seed = 7
    small = sampler.Sampler(num_seqs)
    logits = torch.randn(num_seqs, 16)
    small(logits, seqs)
    recorder.step.clear()
    for _ in range(repeats):
        small(logits, seqs)
    return (recorder.step["sampler"] - recorder.step["sampler inputs"]) / repeats


def host_ms(phases: dict[str, float]) -> float:
    """Host milliseconds per decode step on a GPU: every phase but the device work, plus the sampler's host cost."""
    return sum(ms for phase, ms in phases.items() if phase not in DEVICE)


def skip_forward() -> None:
    """The decode forward returns zeros (the LM head and the sampler still run)."""
    def run_decode(model, buffers, batch_size: int, max_context_len: int) -> torch.Tensor:
        buffers.inputs(batch_size, max_context_len)
        buffers.hidden[:batch_size].zero_()
        return buffers.hidden[:batch_size]

    cuda_graphs.run_decode = model_runner.run_decode = run_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--repeats", type=int, default=1, help="runs; the one with the least host time is shown "
                                                                 "(a shared machine's noise only adds time)")
    parser.add_argument("--no-forward", action="store_true",
                        help="skip the model's decode forward (zeros instead): quicker, and the host phases do not "
                             "depend on it")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="thread: this thread's CPU time, not inflated by other processes on a shared machine")
    args = parser.parse_args()
    if args.clock == "thread":
        CLOCK[0] = time.thread_time
    n = 8
    with tempfile.TemporaryDirectory() as folder:
        path = make_model("tiny", Path(folder) / "tiny", dtype="float32", progress=False)
        engine = LLM(str(path), device="cpu", dtype="float32", max_model_len=args.prompt_len + args.output_len + 1,
                     max_num_seqs=args.prompts * n, block_size=16, max_n=n,
                     enable_prefix_caching=not args.no_prefix_caching)
        rng = random.Random(0)
        prompts = [[rng.randrange(1000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        params = [SamplingParams(temperature=1.0, seed=i, n=n, max_tokens=args.output_len, ignore_eos=True)
                  for i in range(args.prompts)]
        engine.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        if args.no_forward:
            skip_forward()
        recorder, phases = Recorder(), None
        recorder.wrap()
        for _ in range(args.repeats):
            recorder.reset()
            engine.reset_prefix_cache()
            start = CLOCK[0]()
            engine.generate(prompts, params, use_tqdm=False)
            wall = CLOCK[0]() - start
            run = recorder.report(wall, sampler_host_seconds(recorder, args.prompts * n))
            if phases is None or host_ms(run) < host_ms(phases):
                phases = run
    total = sum(v for k, v in phases.items() if k != "sampler host")
    print(f"[{args.clock} clock] {args.prompts} prompts x {n} samples = {args.prompts * n} sequences, prompt "
          f"{args.prompt_len} tokens, {recorder.num_decode_steps} decode steps: {total:.2f} ms per decode step in all "
          f"(the tiny model's forward included); ms per decode step, by phase (own time):")
    for phase, ms in phases.items():
        note = " (device work on a GPU)" if phase in DEVICE else ""
        if phase == "sampler host":
            note = " (the sampler on 16-token logits, inputs apart: its host cost)"
        print(f"  {phase:15s} {ms:7.3f}{note}")
    host = host_ms(phases) - phases["sampler host"]
    print(f"  {'host, Python':15s} {host:7.3f} (every phase but the device work)")
    print(f"  {'host, on a GPU':15s} {host + phases['sampler host']:7.3f} (with the sampler's host cost)")
    behind = phases["sampler inputs"] + phases["sampler host"]
    print(f"  {'host, exposed':15s} {host + phases['sampler host'] - behind:7.3f} (the device waits: all but the "
          f"sampler's {behind:.3f}, done behind the forward)")


if __name__ == "__main__":
    main()
