"""Colocated GRPO: a trainer process (transformers + AdamW) and a `torpor serve` engine on the same device.

Each step: rollout with logprobs (n samples per prompt) → `POST /sleep?level=2` → GRPO train step →
`POST /wake_up?tags=weights` → push the new weights (`update_weights_from_tensor`: CUDA IPC on GPU,
shared memory on CPU) → `POST /wake_up?tags=kv_cache` → next rollout.

The task has a checkable reward: the fraction of sampled tokens whose id is a multiple of 4 (a target token
set; 25% by chance at the start). Per step it prints the mean reward, the train-inference mismatch (max and
mean |engine logprob − trainer logprob| over the sampled tokens, the trainer's logprobs computed with the
weights the engine sampled with) and the seconds spent in sleep, wake, push, rollout and training. The last
line reads `train-inference max |logprob diff| <value>` (fp32 on CPU: ≤ 1e-4).

    python examples/colocated_grpo.py --device cpu --steps 4
    python examples/colocated_grpo.py --device cuda --preset qwen3-0.6b --dtype bfloat16 --steps 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from torpor.rl.engine_process import EngineProcess

ADMIN = "grpo-admin"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    p.add_argument("--preset", default="tiny", help="synthetic checkpoint preset (tiny, qwen3-0.6b, ...)")
    p.add_argument("--model", default=None, help="an existing checkpoint folder instead of --preset")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (the GRPO group), >= 4")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip")
    p.add_argument("--epochs", type=int, default=2, help="optimizer steps per rollout (the ratio moves after 1)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.n < 4:
        p.error("--n must be >= 4 (a GRPO group)")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    return args


def reward(token_ids: list[int]) -> float:
    """The task: emit tokens from the target set (ids that are multiples of 4)."""
    return sum(t % 4 == 0 for t in token_ids) / max(1, len(token_ids))


# ---- the engine, a `torpor serve` process ---------------------------------------------------------------
class Engine(EngineProcess):
    """The rollout engine: `torpor serve` on the same device, sampled over HTTP."""

    def __init__(self, model: str, args: argparse.Namespace) -> None:
        serve_args = ["--device", args.device, "--dtype", args.dtype,
                      "--max-model-len", str(args.prompt_len + args.max_tokens + 8),
                      "--max-num-seqs", str(args.prompts * args.n)]
        if args.device != "cpu":
            serve_args += ["--gpu-memory-utilization", "0.3"]
        super().__init__(model, serve_args, ADMIN)
        self.use_n = True  # ask for n samples in one request; fall back to n requests if the server refuses

    def samples(self, prompt: list[int], n: int, seed: int, max_tokens: int) -> list[tuple[list[int], list[float]]]:
        """n sampled completions of `prompt`: (token ids, the engine's logprob of each)."""
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "logprobs": 0,
                "ignore_eos": True, "return_token_ids": True}
        if self.use_n:
            response = self.http.post("/v1/completions", json={**body, "n": n, "seed": seed})
            if response.status_code == 200:
                return [_sample(choice) for choice in response.json()["choices"]]
            if response.json().get("error", {}).get("param") != "n":
                raise RuntimeError(f"completion failed: {response.text}")
            self.use_n = False  # this server has no `n` yet: one request per sample
        with ThreadPoolExecutor(n) as pool:
            answers = list(pool.map(lambda i: self.post("/v1/completions", json={**body, "seed": seed + i}), range(n)))
        return [_sample(a["choices"][0]) for a in answers]


def _sample(choice: dict) -> tuple[list[int], list[float]]:
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


# ---- the trainer ----------------------------------------------------------------------------------------
def token_logprobs(model, prompt: list[int], completions: list[list[int]], device) -> torch.Tensor:
    """[samples, completion length] log p(token) under `model` (all completions have the same length)."""
    ids = torch.tensor([prompt + c for c in completions], device=device)
    logits = model(ids).logits[:, len(prompt) - 1:-1].float()  # the positions that predict the completion
    targets = ids[:, len(prompt):]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def grpo_step(model, optimizer, groups, args, device) -> tuple[list[float], float]:
    """One GRPO update from `groups` (prompt, [(tokens, engine logprobs)], rewards). Returns the
    |engine − trainer| logprob differences (the weights the engine sampled with) and the seconds."""
    start = time.perf_counter()
    diffs, batches = [], []
    with torch.no_grad():
        for prompt, samples, rewards in groups:
            completions = [tokens for tokens, _ in samples]
            old = token_logprobs(model, prompt, completions, device)
            engine = torch.tensor([lps for _, lps in samples], device=device)
            diffs += (engine - old).abs().flatten().tolist()
            r = torch.tensor(rewards, device=device)
            advantages = (r - r.mean()) / (r.std() + 1e-6)  # group-normalized
            batches.append((prompt, completions, old, advantages))
    for _ in range(args.epochs):
        optimizer.zero_grad()
        loss = 0.0
        for prompt, completions, old, advantages in batches:
            new = token_logprobs(model, prompt, completions, device)
            ratio = torch.exp(new - old)
            a = advantages.unsqueeze(-1)
            clipped = torch.clamp(ratio, 1 - args.clip, 1 + args.clip)
            loss = loss - torch.min(ratio * a, clipped * a).mean() / len(batches)
        loss.backward()
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return diffs, time.perf_counter() - start


def device_memory_by_process(pids: dict[str, int]) -> str:
    """NVML: device memory each process uses (GPU only)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        used: dict[int, int] = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                used[p.pid] = used.get(p.pid, 0) + (p.usedGpuMemory or 0)
        if not set(pids.values()) & set(used):  # another PID namespace (a container): show every process
            return "processes " + ", ".join(f"pid {pid} {b / 2**20:.0f} MiB" for pid, b in sorted(used.items()))
        return ", ".join(f"{name} {used.get(pid, 0) / 2**20:.0f} MiB" for name, pid in pids.items())
    except Exception as e:  # no NVML (CPU), or no permission
        return f"n/a ({type(e).__name__})"


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    from torpor.rl import WeightPusher
    from torpor.synthetic import make_model

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    workdir = tempfile.TemporaryDirectory(prefix="torpor-grpo-")
    model_path = args.model or str(make_model(args.preset, Path(workdir.name) / args.preset, dtype=args.dtype,
                                              progress=False))
    dtype = getattr(torch, args.dtype)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    trainer.config.use_cache = False
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=args.lr)
    vocab = trainer.config.vocab_size
    engine = Engine(model_path, args)
    pusher = WeightPusher(engine.url, ADMIN)
    all_diffs: list[float] = []
    try:
        for step in range(args.steps):
            t = time.perf_counter()
            generator = torch.Generator().manual_seed(args.seed * 1000 + step)
            prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=generator).tolist()
                       for _ in range(args.prompts)]
            seeds = [(step * 100 + i) * args.n for i in range(args.prompts)]  # distinct per sample
            with ThreadPoolExecutor(args.prompts) as pool:
                rollouts = list(pool.map(lambda p, s: engine.samples(p, args.n, s, args.max_tokens), prompts, seeds))
            groups = [(p, s, [reward(tokens) for tokens, _ in s]) for p, s in zip(prompts, rollouts, strict=True)]
            rollout_s = time.perf_counter() - t

            t = time.perf_counter()
            engine.post("/sleep", params={"level": 2})
            sleep_s = time.perf_counter() - t
            diffs, train_s = grpo_step(trainer, optimizer, groups, args, device)
            # after the step: the trainer's cached memory holds its peak; the engine is still asleep
            memory = device_memory_by_process({"trainer": os.getpid(), "engine (asleep)": engine.process.pid}) \
                if device.type == "cuda" else None
            all_diffs += diffs

            t = time.perf_counter()
            engine.post("/wake_up", params={"tags": "weights"})
            wake_s = time.perf_counter() - t
            report = pusher.push(trainer.named_parameters())
            t = time.perf_counter()
            state = engine.post("/wake_up", params={"tags": "kv_cache"})
            wake_s += time.perf_counter() - t
            if not state["serving"]:
                raise RuntimeError(f"the engine does not serve after the push: {state}")

            mean_reward = statistics.fmean(r for _, _, rs in groups for r in rs)
            print(f"step {step + 1}: reward {mean_reward:.3f} | mismatch max {max(diffs):.2e} mean "
                  f"{statistics.fmean(diffs):.2e} | sleep {sleep_s:.3f} s wake {wake_s:.3f} s push "
                  f"{report.seconds:.3f} s ({report.gbps:.2f} GB/s) rollout {rollout_s:.3f} s train {train_s:.3f} s"
                  + (f" | device memory at the train step: {memory}" if memory else ""), flush=True)
    except BaseException:
        print(engine.output(), file=sys.stderr)
        raise
    finally:
        pusher.close()
        engine.close()
        workdir.cleanup()
    quantiles = statistics.quantiles(all_diffs, n=100)
    print(f"mismatch distribution over {len(all_diffs)} sampled tokens: p50 {quantiles[49]:.2e} "
          f"p90 {quantiles[89]:.2e} p99 {quantiles[98]:.2e} max {max(all_diffs):.2e}")
    print(f"train-inference max |logprob diff| {max(all_diffs):.3e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
