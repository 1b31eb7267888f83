"""Colocated GRPO: a trainer process (transformers + AdamW) and a `torpor serve` engine on the same device.

Each step: rollout with logprobs (n samples per prompt) → `POST /sleep?level=2` → GRPO train step →
`POST /wake_up?tags=weights` → push the new weights (`update_weights_from_tensor`: CUDA IPC on GPU,
shared memory on CPU) → `POST /wake_up?tags=kv_cache` → next rollout.

The task has a checkable reward: the fraction of sampled tokens that fall in a target set, the quarter of the
vocabulary whose output embeddings point furthest along one fixed random direction (25% by chance at the
start). Such a set is one direction of the model's last hidden state, so a policy can learn to favour it as a
whole within a few steps at any vocabulary size; an arbitrary set (every fourth id, say) is learnt only token by
token, which a 151,936-token vocabulary does not allow in a few steps. Per step it prints the mean reward, the
train-inference mismatch (max and mean |engine logprob − trainer logprob| over the sampled tokens, the trainer's
logprobs computed with the weights the engine sampled with) and the time spent in sleep, wake, push, rollout and
training; at the end the reward curve (a PNG too with `--plot PATH`), then the line
`train-inference max |logprob diff| <value>` (fp32 on CPU: <= 1e-4), last.

    python examples/colocated_grpo.py --device cpu
    python examples/colocated_grpo.py --device cuda --preset qwen3-0.6b
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
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (the GRPO group), >= 4")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW's learning rate (default: 5.12 / hidden_size, at most 2e-2: 2e-2 for the tiny model, "
                        "5e-3 for qwen3-0.6b. Adam moves each weight by about lr per step, so a layer's output moves "
                        "by about lr x its fan-in; scaling lr with 1 / width keeps its effect alike at every size)")
    p.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip")
    p.add_argument("--epochs", type=int, default=2, help="optimizer steps per rollout (the ratio moves after 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, metavar="PATH", help="also write the reward curve as a PNG here")
    args = p.parse_args(argv)
    if args.n < 4:
        p.error("--n must be >= 4 (a GRPO group)")
    if args.plot and not Path(args.plot).expanduser().absolute().parent.is_dir():
        p.error(f"--plot {args.plot}: the folder does not exist")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    return args


def target_set(model, seed: int) -> torch.Tensor:
    """The task's target tokens, a bool per vocabulary id: the quarter whose rows of the output embedding have
    the largest projection on a fixed random direction (from `seed`), decided once from the initial weights."""
    rows = model.get_output_embeddings().weight.detach().float().cpu()
    direction = torch.randn(rows.shape[1], generator=torch.Generator().manual_seed(seed + 4321))
    projection = rows @ direction
    return projection >= projection.quantile(0.75)


def reward(token_ids: list[int], target: torch.Tensor) -> float:
    """The task: emit tokens from the target set; the fraction of them that are."""
    return target[token_ids].float().mean().item() if token_ids else 0.0


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
def token_logprobs(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """[sequences, completion length] log p(token) under `model` of `ids` [sequences, prompt + completion]
    (every prompt and every completion of a step has the same length: one batch)."""
    logits = model(ids).logits[:, prompt_len - 1:-1].float()  # the positions that predict the completion
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, prompt_len:].unsqueeze(-1)).squeeze(-1)


def grpo_step(model, optimizer, groups, args, device) -> tuple[list[float], float]:
    """One GRPO update from `groups` (prompt, [(tokens, engine logprobs)], rewards). Returns the
    |engine − trainer| logprob differences (the weights the engine sampled with) and the seconds."""
    start = time.perf_counter()
    ids = torch.tensor([prompt + tokens for prompt, samples, _ in groups for tokens, _ in samples], device=device)
    engine = torch.tensor([lps for _, samples, _ in groups for _, lps in samples], device=device)
    rewards = torch.tensor([rs for _, _, rs in groups], device=device)  # [prompts, n]
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
    with torch.no_grad():
        old = token_logprobs(model, ids, args.prompt_len)
    diffs = (engine - old).abs().flatten().tolist()
    a = advantages.unsqueeze(-1)  # group-normalized, one per sequence
    for _ in range(args.epochs):
        optimizer.zero_grad()
        ratio = torch.exp(token_logprobs(model, ids, args.prompt_len) - old)
        clipped = torch.clamp(ratio, 1 - args.clip, 1 + args.clip)
        (-torch.min(ratio * a, clipped * a).mean()).backward()
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
    from transformers.utils import logging as transformers_logging

    from torpor.rl import WeightPusher
    from torpor.synthetic import make_model

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    workdir = tempfile.TemporaryDirectory(prefix="torpor-grpo-")
    model_path = args.model or str(make_model(args.preset, Path(workdir.name) / args.preset, dtype=args.dtype,
                                              progress=False))
    dtype = getattr(torch, args.dtype)
    transformers_logging.disable_progress_bar()  # its "Loading weights" bar, amid the steps
    trainer = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    trainer.config.use_cache = False
    lr = args.lr if args.lr is not None else min(2e-2, 5.12 / trainer.config.hidden_size)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=lr)
    vocab = trainer.config.vocab_size
    target = target_set(trainer, args.seed)
    engine = Engine(model_path, args)
    pusher = WeightPusher(engine.url, ADMIN)
    all_diffs: list[float] = []
    curve: list[float] = []
    print(f"GRPO on {Path(model_path).name}: {args.steps} steps of {args.prompts} prompts x {args.n} samples x "
          f"{args.max_tokens} tokens, AdamW lr {lr:.3g}; reward = the fraction of sampled tokens in the target set "
          f"(25% by chance)", flush=True)
    try:
        for step in range(args.steps):
            t = time.perf_counter()
            generator = torch.Generator().manual_seed(args.seed * 1000 + step)
            prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=generator).tolist()
                       for _ in range(args.prompts)]
            seeds = [(step * 100 + i) * args.n for i in range(args.prompts)]  # distinct per sample
            with ThreadPoolExecutor(args.prompts) as pool:
                rollouts = list(pool.map(lambda p, s: engine.samples(p, args.n, s, args.max_tokens), prompts, seeds))
            groups = [(p, s, [reward(tokens, target) for tokens, _ in s])
                      for p, s in zip(prompts, rollouts, strict=True)]
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
            curve.append(mean_reward)
            print(f"step {step + 1}: reward {mean_reward:.3f} | mismatch max {max(diffs):.2e} mean "
                  f"{statistics.fmean(diffs):.2e} | sleep {_ms(sleep_s)} wake {_ms(wake_s)} push {_ms(report.seconds)} "
                  f"({_rate(report.bytes, report.seconds)}) rollout {_ms(rollout_s)} train {_ms(train_s)}"
                  + (f" | device memory at the train step: {memory}" if memory else ""), flush=True)
    except BaseException:
        print(engine.output(), file=sys.stderr)
        raise
    finally:
        pusher.close()
        engine.close()
        workdir.cleanup()
    print_curve(curve)
    if args.plot:
        plot_curve(curve, args.plot)
        print(f"reward curve written to {args.plot}")
    quantiles = statistics.quantiles(all_diffs, n=100)
    print(f"mismatch distribution over {len(all_diffs)} sampled tokens: p50 {quantiles[49]:.2e} "
          f"p90 {quantiles[89]:.2e} p99 {quantiles[98]:.2e} max {max(all_diffs):.2e}")
    print(f"train-inference max |logprob diff| {max(all_diffs):.3e}", flush=True)
    return 0


def print_curve(curve: list[float]) -> None:
    """The mean reward per step as a bar each, 0 to 1, and the gain of the last two steps over the first."""
    print("reward per step (0 to 1):")
    for step, value in enumerate(curve, 1):
        print(f"  {step:3d} {value:.3f} {'#' * round(40 * value)}")
    if len(curve) >= 3:
        last = statistics.fmean(curve[-2:])
        print(f"reward: first step {curve[0]:.3f}, last two steps {last:.3f} ({last - curve[0]:+.3f})")


def plot_curve(curve: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(curve) + 1), curve, marker="o")
    ax.axhline(0.25, color="grey", linestyle="--", linewidth=1, label="chance (25%)")
    ax.set(xlabel="step", ylabel="mean reward", ylim=(0, 1), title="colocated GRPO: reward per step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _rate(nbytes: int, seconds: float) -> str:
    per_s = nbytes / seconds if seconds > 0 else 0.0
    return f"{per_s / 1e9:.1f} GB/s" if per_s >= 1e9 else f"{per_s / 1e6:.0f} MB/s"


if __name__ == "__main__":
    sys.exit(main())
