"""GRPO on Ray: a trainer actor (transformers + AdamW) and a `RolloutFleet` of torpor engines.

Each step: rollout across the fleet (the n samples of a prompt on one replica, its prefix cache shared) →
`fleet.sleep(2)` → GRPO train step in the trainer actor → `fleet.wake_up(["weights"])` → the trainer broadcasts
its new weights over one process group to every replica's ranks at once (gloo on CPU, NCCL on GPU) →
`fleet.wake_up(["kv_cache"])`. The trainer also hands the fleet a host copy of what it sent (`source=`), so a
replica restarted later catches up to the same weights.

The task and the printed figures are examples/colocated_grpo.py's: per step the mean reward, the train-inference
mismatch (|engine logprob − trainer logprob| over the sampled tokens, with the weights the engine sampled with)
and the seconds per phase; the last line reads `train-inference max |logprob diff| <value>` (fp32: ≤ 1e-4).

    python examples/ray_grpo.py --device cpu --replicas 2 --steps 4
    python examples/ray_grpo.py --device cuda --replicas 4 --preset qwen3-0.6b --dtype bfloat16 --steps 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import colocated_grpo  # (the task, the loss and the GRPO step are that example's)

from torpor import SamplingParams
from torpor.ray import GroupBroadcaster, RolloutFleet, spec
from torpor.rl.engine_process import free_port

ray.cloudpickle.register_pickle_by_value(colocated_grpo)  # the trainer actor runs its functions, shipped by value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--replicas", type=int, default=2, help="engine replicas in the fleet")
    p.add_argument("--preset", default="tiny", help="synthetic checkpoint preset (tiny, qwen3-0.6b, ...)")
    p.add_argument("--model", default=None, help="an existing checkpoint folder instead of --preset")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (the GRPO group), >= 4")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip")
    p.add_argument("--epochs", type=int, default=2, help="optimizer steps per rollout")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.n < 4:
        p.error("--n must be >= 4 (a GRPO group)")
    if args.device not in ("cpu", "cuda"):
        p.error("--device must be cpu or cuda")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    return args


@ray.remote
class Trainer:
    """The policy and its optimizer, on its own CPU or GPU; rank 0 of the weights update group."""

    def __init__(self, model_path: str, args: argparse.Namespace) -> None:
        import transformers

        torch.manual_seed(args.seed)
        self.args = args
        self.device = torch.device("cuda" if args.device == "cuda" else "cpu")
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, args.dtype)).to(self.device)
        self.model.config.use_cache = False
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.group: GroupBroadcaster | None = None

    def address(self) -> str:
        return ray.util.get_node_ip_address()

    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def target(self) -> torch.Tensor:
        """The task's target tokens (examples/colocated_grpo.py's, from the initial weights)."""
        return colocated_grpo.target_set(self.model, self.args.seed)

    def open_group(self, master_address: str, master_port: int, world_size: int, group_name: str) -> None:
        self.group = GroupBroadcaster(master_address, master_port, world_size, group_name, device=self.device)
        self.group.open()  # returns once every replica's ranks joined

    def spec(self):
        return spec(self.model.named_parameters())

    def broadcast(self) -> float:
        with torch.no_grad():
            return self.group.broadcast(self.model.named_parameters())

    def snapshot(self) -> list[tuple[str, torch.Tensor]]:
        """A host copy of the weights just sent: what a restarted replica is given."""
        return [(n, p.detach().to("cpu", copy=True)) for n, p in self.model.named_parameters()]

    def train(self, groups) -> tuple[list[float], float]:
        return colocated_grpo.grpo_step(self.model, self.optimizer, groups, self.args, self.device)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()


def rollout(fleet: RolloutFleet, prompts: list[list[int]], args, step: int, target: torch.Tensor):
    """n samples per prompt: (prompt, [(tokens, engine logprobs)], rewards) per prompt."""
    params = [SamplingParams(n=args.n, temperature=1.0, seed=(step * 100 + i) * args.n, max_tokens=args.max_tokens,
                             logprobs=0, ignore_eos=True) for i in range(len(prompts))]
    outputs = fleet.generate(prompts, params, group_ids=[f"step{step}-prompt{i}" for i in range(len(prompts))])
    groups = []
    for prompt, output in zip(prompts, outputs, strict=True):
        samples = [(list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)])
                   for c in output.outputs]
        groups.append((prompt, samples, [colocated_grpo.reward(tokens, target) for tokens, _ in samples]))
    return groups


def main(argv=None) -> int:
    args = parse_args(argv)
    from torpor.synthetic import make_model

    ray.init(address="local", num_cpus=args.replicas + 2, include_dashboard=False, log_to_driver=False)
    workdir = tempfile.TemporaryDirectory(prefix="torpor-ray-grpo-")
    model_path = args.model or str(make_model(args.preset, Path(workdir.name) / args.preset, dtype=args.dtype,
                                              progress=False))
    engine_kwargs = {"dtype": args.dtype, "max_model_len": args.prompt_len + args.max_tokens + 8,
                     "max_num_seqs": args.prompts * args.n}
    if args.device == "cpu":
        engine_kwargs["num_kv_blocks"] = 16 * args.prompts * args.n
    else:
        engine_kwargs["gpu_memory_utilization"] = 0.3
    trainer = Trainer.options(num_cpus=1, num_gpus=1 if args.device == "cuda" else 0).remote(model_path, args)
    fleet = RolloutFleet(model_path, num_replicas=args.replicas, device=args.device, engine_kwargs=engine_kwargs)
    all_diffs: list[float] = []
    try:
        address, vocab, target = ray.get([trainer.address.remote(), trainer.vocab_size.remote(),
                                          trainer.target.remote()])
        port, world, name = free_port(), fleet.group_world_size(), "grpo"
        opened = trainer.open_group.remote(address, port, world, name)
        fleet.init_weights_update_group(address, port, 1, world, name, "nccl" if args.device == "cuda" else "gloo")
        ray.get(opened)
        names, dtypes, shapes = ray.get(trainer.spec.remote())
        for step in range(args.steps):
            t = time.perf_counter()
            generator = torch.Generator().manual_seed(args.seed * 1000 + step)
            prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=generator).tolist()
                       for _ in range(args.prompts)]
            groups = rollout(fleet, prompts, args, step, target)
            rollout_s = time.perf_counter() - t

            t = time.perf_counter()
            fleet.sleep(2)
            sleep_s = time.perf_counter() - t
            diffs, train_s = ray.get(trainer.train.remote(groups))
            all_diffs += diffs

            t = time.perf_counter()
            fleet.wake_up(["weights"])
            wake_s = time.perf_counter() - t
            t = time.perf_counter()
            sent = trainer.broadcast.remote()  # the trainer broadcasts while every replica receives
            fleet.update_weights_from_distributed(names, dtypes, shapes, name, source=trainer.snapshot.remote())
            ray.get(sent)
            push_s = time.perf_counter() - t
            t = time.perf_counter()
            woken = fleet.wake_up(["kv_cache"])
            wake_s += time.perf_counter() - t
            if not all(w.serving for w in woken):
                raise RuntimeError(f"a replica does not serve after the push: {fleet.stats()}")

            mean_reward = statistics.fmean(r for _, _, rs in groups for r in rs)
            print(f"step {step + 1}: reward {mean_reward:.3f} | mismatch max {max(diffs):.2e} mean "
                  f"{statistics.fmean(diffs):.2e} | sleep {sleep_s:.3f} s wake {wake_s:.3f} s push {push_s:.3f} s "
                  f"rollout {rollout_s:.3f} s train {train_s:.3f} s | weight version {fleet.weight_version}",
                  flush=True)
        fleet.destroy_weights_update_group(name)
    finally:
        ray.get(trainer.close.remote(), timeout=30)
        fleet.shutdown()
        ray.shutdown()
        workdir.cleanup()
    quantiles = statistics.quantiles(all_diffs, n=100)
    print(f"mismatch distribution over {len(all_diffs)} sampled tokens: p50 {quantiles[49]:.2e} "
          f"p90 {quantiles[89]:.2e} p99 {quantiles[98]:.2e} max {max(all_diffs):.2e}")
    print(f"train-inference max |logprob diff| {max(all_diffs):.3e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
