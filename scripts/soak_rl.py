"""Soak at RL settings: many RL steps against one `torpor serve` process, with this process as the trainer.

Each step: `POST /sleep?level=2`, `/wake_up?tags=weights`, a push of the checkpoint's tensors times a scale of that
step (`WeightPusher`: CUDA IPC on GPU, shared memory on CPU), `/wake_up?tags=kv_cache`, and a rollout of
`--requests` greedy prompts. At the first step, every `--check-every` steps and at the last, the rollout is checked
token for token against an engine started here on that step's weights (the served engine sleeps at level 1
meanwhile), and counted against the checkpoint's own answers (so the check can fail). Every step reads the engine
process's device memory (`GET /memory`), its host RSS and open file descriptors, and the files in /dev/shm; the
end prints their drift. One JSON line at the end (--json to a file too).

    python3 scripts/soak_rl.py MODEL --steps 500 --gmu 0.85 --requests 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def scale_of(step: int) -> float:
    """A different scale at every step, within 5% of 1 (step 0: the checkpoint itself)."""
    return 1.0 if step == 0 else 1.0 + ((step * 37) % 101 - 50) * 1e-3


def scaled(named, step: int):
    s = scale_of(step)
    for name, tensor in named:
        yield name, tensor if s == 1.0 or not tensor.is_floating_point() else (tensor * s).to(tensor.dtype)


def prompts(n: int, vocab: int) -> list[list[int]]:
    return [[(17 + 31 * i + 7 * j) % (vocab - 1) + 1 for j in range(8 + i % 24)] for i in range(n)]


def readings(engine) -> dict:
    pid = engine.pid
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    memory = engine.http.get("/memory").json()
    return {"device_used_bytes": memory.get("device_used_bytes"), "rss_bytes": rss,
            "fds": len(os.listdir(f"/proc/{pid}/fd")), "dev_shm": len(os.listdir("/dev/shm"))}


def rollout(engine, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    body = {"prompt": batch, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    choices = engine.post("/v1/completions", json=body)["choices"]
    return [c["token_ids"] for c in sorted(choices, key=lambda c: c["index"])]


def reference(model: str, named, step: int, batch, max_tokens: int, engine_kwargs: dict) -> list[list[int]]:
    from torpor import LLM, SamplingParams

    llm = LLM(model, **engine_kwargs)
    try:
        if step:
            llm.update_weights(list(scaled(named, step)))
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]
    finally:
        llm.close()
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--gmu", type=float, default=0.85)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--check-every", type=int, default=50)
    parser.add_argument("--reference-gmu", type=float, default=0.5, help="the reference engines' budget (the served "
                        "engine sleeps at level 1 meanwhile; this process holds the trainer's copy of the weights)")
    parser.add_argument("--time-limit", type=float, default=None, help="stop after this many seconds of steps")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from safetensors.torch import load_file

    from torpor.engine.tokenizer import Tokenizer
    from torpor.rl import WeightPusher
    from torpor.rl.engine_process import EngineProcess

    device = "cuda" if torch.cuda.is_available() else "cpu"
    files = sorted(Path(args.model).glob("*.safetensors"))
    named = [item for f in files for item in load_file(str(f), device=device).items()]
    vocab = Tokenizer.from_pretrained(args.model).vocab_size
    batch = prompts(args.requests, vocab)
    shape = ["--max-num-seqs", str(args.requests), "--max-model-len", "1024"]
    engine_kwargs = {"max_num_seqs": args.requests, "max_model_len": 1024}
    serve = ["--device", device, *shape] + (["--gpu-memory-utilization", str(args.gmu)] if device == "cuda" else [])
    if device == "cuda":
        engine_kwargs["gpu_memory_utilization"] = args.reference_gmu
    else:
        engine_kwargs["device"] = "cpu"
    phases = {k: [] for k in ("sleep", "wake_weights", "push", "wake_kv", "rollout", "step")}
    checks, trace = [], []
    start_all = time.perf_counter()
    checkpoint_answers = reference(args.model, named, 0, batch, args.max_tokens, engine_kwargs)
    with EngineProcess(args.model, serve) as engine:
        while not (engine.http.get("/memory").json().get("host_reservation") or {"done": True})["done"]:
            time.sleep(0.1)
        pusher = WeightPusher(engine.url, engine.admin_token)
        base = readings(engine)
        steps_run = 0
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            phases["sleep"].append(engine.timed("/sleep", params={"level": 2}))
            phases["wake_weights"].append(engine.timed("/wake_up", params={"tags": "weights"}))
            phases["push"].append(pusher.push(scaled(named, step)).seconds)
            phases["wake_kv"].append(engine.timed("/wake_up", params={"tags": "kv_cache"}))
            t1 = time.perf_counter()
            tokens = rollout(engine, batch, args.max_tokens)
            phases["rollout"].append(time.perf_counter() - t1)
            phases["step"].append(time.perf_counter() - t0)
            assert all(len(t) == args.max_tokens for t in tokens), "a rollout request came back short"
            steps_run = step
            reading = readings(engine)
            trace.append({"step": step, **reading})
            over = args.time_limit is not None and time.perf_counter() - start_all > args.time_limit
            if step == 1 or step % args.check_every == 0 or step == args.steps or over:
                engine.post("/sleep", params={"level": 1})
                want = reference(args.model, named, step, batch, args.max_tokens, engine_kwargs)
                engine.post("/wake_up")
                same = sum(a == b for a, b in zip(tokens, want, strict=True))
                moved = sum(a != b for a, b in zip(want, checkpoint_answers, strict=True))  # the check can fail
                checks.append({"step": step, "scale": scale_of(step), "identical": same, "of": len(want),
                               "differ_from_checkpoint": moved})
                print(f"step {step}: {same}/{len(want)} identical to an engine started on its weights ({moved} differ "
                      f"from the checkpoint's); "
                      f"step {phases['step'][-1]:.3f} s; device {reading['device_used_bytes'] / 2**20:.0f} MiB, "
                      f"RSS {reading['rss_bytes'] / 2**20:.0f} MiB, fds {reading['fds']}, /dev/shm "
                      f"{reading['dev_shm']}", flush=True)
            if over:
                break
        pusher.close()
        end = readings(engine)
    first, last = trace[0], trace[-1]
    result = {
        "model": args.model, "device": device, "gmu": args.gmu, "steps": steps_run, "requests": args.requests,
        "max_tokens": args.max_tokens, "seconds": time.perf_counter() - start_all,
        "median_s": {k: statistics.median(v) for k, v in phases.items()},
        "checks": checks, "all_exact": all(c["identical"] == c["of"] for c in checks),
        "baseline": base, "after_step_1": first, "last": last, "end": end,
        "drift_per_step": {k: (last[k] - first[k]) / max(1, steps_run - 1) for k in
                           ("device_used_bytes", "rss_bytes", "fds", "dev_shm") if first[k] is not None},
    }
    print(json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    sys.exit(0 if result["all_exact"] else 1)


if __name__ == "__main__":
    main()
