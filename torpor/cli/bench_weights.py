"""`torpor bench weights`: weights from a trainer process into the engine, measured in one run.

This process is the trainer: it holds the model's tensors on the device (default: the synthetic qwen3-8b on
GPU 0, the tiny model on CPU) and pushes them into a `torpor serve` engine on the same device by
`update_weights_from_tensor` in flattened buckets (CUDA IPC on GPU, shared memory on CPU). Measured:
- push: seconds and GB/s of a whole push (median of `--repeat`), goal ≤ 0.1 s for qwen3-8b on an H200;
- the RL-step overhead: sleep level 2 + wake weights + push + wake kv_cache, goal ≤ 0.6 s;
- side by side: `POST /reload_weights` (from disk), and in this process an `LLM`'s `update_weights` and
  `update_weights_from_tensor` with the same tensors;
- with `--distributed` and 2 GPUs: the engine on GPU 0, the trainer on GPU 1, `update_weights_from_distributed`
  over NCCL against a raw NCCL broadcast of the same tensors between two processes in the same run
  (goal ≥ 80%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

GB = 1e9


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("weights", help="weight push from a trainer process: IPC / shared memory / NCCL",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder or preset (default: qwen3-8b on GPU, tiny on CPU)")
    p.add_argument("--device", default="auto")
    p.add_argument("--bucket-mb", type=float, default=512, help="flattened bucket size (MiB; fractions allowed, "
                   "e.g. 0.25 to make the per-bucket costs of a small model visible)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--distributed", action="store_true", help="also the NCCL path, trainer on the next GPU")
    p.add_argument("--skip-in-process", action="store_true", help="skip the in-process LLM comparison")
    p.add_argument("--json", default=None, help="also write the results here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from torpor.cli.bench_sleep import resolve_model
    from torpor.engine.llm import _resolve_device
    from torpor.engine.loader import iter_checkpoint

    device = _resolve_device(args.device)
    model = resolve_model(args.model, device)
    tensors = [(name, t.to(device)) for name, t in iter_checkpoint(model)]  # the trainer's weights
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    print(f"model {model}: {len(tensors)} tensors, {nbytes / 2**30:.2f} GiB on {device}")
    results: dict = {"model": model, "device": device, "bytes": nbytes, "bucket_mb": args.bucket_mb}
    results["serve"] = bench_serve(model, device, tensors, args)
    if not args.skip_in_process:
        results["in_process"] = bench_in_process(model, device, tensors, args)
    if args.distributed:
        results["distributed"] = bench_distributed(model, device, tensors, args)
    print_summary(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _bucket_bytes(args: argparse.Namespace) -> int:
    return max(1, int(args.bucket_mb * 2**20))


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _serve_args(device: str) -> list[str]:
    args = ["--device", device, "--max-model-len", "2048", "--max-num-seqs", "64"]
    return args + (["--gpu-memory-utilization", "0.35"] if device.startswith("cuda") else [])


def _greedy(engine) -> list[int]:
    body = {"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    return engine.post("/v1/completions", json=body)["choices"][0]["token_ids"]


def bench_serve(model: str, device: str, tensors, args) -> dict:
    """The engine as a `torpor serve` process on the same device; this process pushes."""
    from torpor.rl import WeightPusher
    from torpor.rl.engine_process import EngineProcess

    with EngineProcess(model, _serve_args(device)) as engine:
        pusher = WeightPusher(engine.url, engine.admin_token, bucket_bytes=_bucket_bytes(args))
        before = _greedy(engine)
        pusher.push(tensors)  # warm-up (first IPC opens, code paths)
        pushes = [pusher.push(tensors) for _ in range(args.repeat)]
        one_request = WeightPusher(engine.url, engine.admin_token, bucket_bytes=_bucket_bytes(args),
                                   buckets_per_request=1 << 20)  # every bucket in one request (torpor's extension)
        one_request.push(tensors)
        single = [one_request.push(tensors).seconds for _ in range(args.repeat)]
        same = _greedy(engine) == before  # the same weights pushed back: the same answers
        steps = []
        for _ in range(args.repeat):
            sleep = engine.timed("/sleep", params={"level": 2})
            wake_weights = engine.timed("/wake_up", params={"tags": "weights"})
            push = pusher.push(tensors).seconds
            wake_kv = engine.timed("/wake_up", params={"tags": "kv_cache"})
            steps.append({"sleep": sleep, "wake_weights": wake_weights, "push": push, "wake_kv": wake_kv,
                          "total": sleep + wake_weights + push + wake_kv})
        after_cycle = _greedy(engine) == before
        reloads = [engine.timed("/reload_weights") for _ in range(min(2, args.repeat))]
        pusher.close()
        one_request.close()
    push_s = _median([p.seconds for p in pushes])
    result = {"push_s": push_s, "push_gbps": pushes[0].bytes / push_s / GB, "buckets": pushes[0].buckets,
              "push_engine_s": _median([p.engine_seconds for p in pushes]),
              "push_phases_ms_per_request": phases_per_request(pushes),
              "rl_step": {k: _median([s[k] for s in steps]) for k in steps[0]},
              "reload_weights_s": _median(reloads), "answers_unchanged": same and after_cycle,
              "push_one_request_s": _median(single)}
    print(f"serve push: {push_s:.4f} s ({result['push_gbps']:.1f} GB/s, {pushes[0].buckets} buckets; "
          f"{result['push_engine_s']:.4f} s of it in the engine's handler); "
          f"RL step {result['rl_step']}; reload_weights {result['reload_weights_s']:.3f} s; "
          f"answers unchanged: {result['answers_unchanged']}")
    print(f"serve push, engine per request: {format_phases(result['push_phases_ms_per_request'])}")
    return result


def phases_per_request(reports) -> dict[str, float]:
    """Median milliseconds per request of each engine phase (`PushReport.engine_phases`), plus "other" (the
    handler's time in no phase), "outside" (the push's time outside the engine's handler: bucketing,
    pickling, HTTP; partly overlapped with the engine) and "push" (the whole push per request)."""
    names = sorted({name for r in reports for name in r.engine_phases} - {"total"})
    per = {name: _median([r.engine_phases.get(name, 0.0) * 1e3 / max(r.requests, 1) for r in reports])
           for name in names}
    total = _median([r.engine_phases.get("total", r.engine_seconds) * 1e3 / max(r.requests, 1) for r in reports])
    per["other"] = max(0.0, total - sum(per.values()))
    per["engine"] = total
    per["outside"] = _median([(r.seconds - r.engine_seconds) * 1e3 / max(r.requests, 1) for r in reports])
    per["push"] = _median([r.seconds * 1e3 / max(r.requests, 1) for r in reports])
    return per


PHASE_ORDER = ("decode", "check", "plan", "finite", "copy", "buffers", "sync", "sentinel", "release", "other")


def format_phases(per: dict[str, float]) -> str:
    """'decode 0.31 + check 0.02 + ... = engine 1.20 ms; outside 0.80 ms; push 2.00 ms' (known phases first)."""
    names = [n for n in PHASE_ORDER if n in per] + sorted(set(per) - set(PHASE_ORDER) - {"engine", "outside", "push"})
    parts = " + ".join(f"{n} {per[n]:.3f}" for n in names)
    text = f"{parts} = engine {per.get('engine', 0.0):.3f} ms"
    if "outside" in per:
        text += f"; outside the engine's handler {per['outside']:.3f} ms; whole push {per['push']:.3f} ms"
    return text


def bench_in_process(model: str, device: str, tensors, args) -> dict:
    """An `LLM` in this process: `update_weights` (per tensor) and `update_weights_from_tensor` (buckets)."""
    from torpor.engine import LLM, phase_times
    from torpor.rl import PushReport, bucket_named_tensors

    llm = LLM(model, device=device, max_model_len=2048, max_num_seqs=64,
              gpu_memory_utilization=0.35 if device.startswith("cuda") else 0.9)
    try:
        update, from_tensor, phases = [], [], []
        buckets = list(bucket_named_tensors(tensors, _bucket_bytes(args)))
        for _ in range(args.repeat + 1):
            _sync(device)
            start = time.perf_counter()
            llm.update_weights(tensors)
            _sync(device)
            update.append(time.perf_counter() - start)
            report = PushReport(0.0, 0, len(buckets), 0, requests=len(buckets))
            start = time.perf_counter()
            for bucket in buckets:
                with phase_times.collect() as timings:
                    llm.update_weights_from_tensor(bucket.payload(), load_format="flattened_bucket")
                for name, seconds in timings.items():
                    report.engine_phases[name] = report.engine_phases.get(name, 0.0) + seconds
            _sync(device)
            from_tensor.append(time.perf_counter() - start)
            report.seconds = report.engine_seconds = from_tensor[-1]
            phases.append(report)
    finally:
        llm.close()
        del llm
    result = {"update_weights_s": _median(update[1:]), "update_weights_from_tensor_s": _median(from_tensor[1:]),
              "phases_ms_per_bucket": phases_per_request(phases[1:])}
    result["phases_ms_per_bucket"].pop("outside")
    result["phases_ms_per_bucket"].pop("push")
    print(f"in process: update_weights {result['update_weights_s']:.4f} s, update_weights_from_tensor "
          f"(buckets, no IPC) {result['update_weights_from_tensor_s']:.4f} s")
    print(f"in process, update_weights_from_tensor per bucket: {format_phases(result['phases_ms_per_bucket'])}")
    return result


def bench_distributed(model: str, device: str, tensors, args) -> dict:
    """Engine on `device`, trainer on the next GPU: NCCL update group against a raw NCCL broadcast."""
    if not device.startswith("cuda") or torch.cuda.device_count() < 2:
        print("distributed: skipped (needs 2 GPUs)")
        return {"skipped": "needs 2 GPUs"}
    from torpor.rl import DistributedPusher
    from torpor.rl.engine_process import EngineProcess

    engine_index = torch.device(device).index or 0
    trainer_device = f"cuda:{(engine_index + 1) % torch.cuda.device_count()}"
    moved = [(n, t.to(trainer_device)) for n, t in tensors]
    raw = raw_nccl_broadcast(moved, trainer_device, device, args.repeat)
    with EngineProcess(model, _serve_args(device)) as engine:
        pusher = DistributedPusher(engine.url, engine.admin_token, "127.0.0.1", _free_port(), trainer_device,
                                   backend="nccl")
        try:
            pusher.push(moved)  # warm-up
            pushes = [pusher.push(moved).seconds for _ in range(args.repeat)]
        finally:
            pusher.close()
    nbytes = sum(t.numel() * t.element_size() for _, t in moved)
    push_s = _median(pushes)
    result = {"push_s": push_s, "push_gbps": nbytes / push_s / GB, "raw_broadcast_s": raw,
              "raw_broadcast_gbps": nbytes / raw / GB, "fraction_of_raw": raw / push_s}
    print(f"distributed (NCCL, {trainer_device} -> {device}): push {push_s:.4f} s ({result['push_gbps']:.1f} GB/s); "
          f"raw broadcast {raw:.4f} s ({result['raw_broadcast_gbps']:.1f} GB/s); {100 * raw / push_s:.0f}% of raw")
    return result


def raw_nccl_broadcast(tensors, src_device: str, dst_device: str, repeat: int) -> float:
    """Median seconds to broadcast `tensors` (in order) from this process to a helper process on
    `dst_device`, over the same kind of standalone group: the link's own figure."""
    import multiprocessing

    from torpor.engine.weight_transfer import broadcast, open_update_group

    port = _free_port()
    specs = [(list(t.shape), t.dtype) for _, t in tensors]
    context = multiprocessing.get_context("spawn")
    helper = context.Process(target=_raw_receiver, args=(port, specs, dst_device, repeat + 1), daemon=True)
    helper.start()
    group = open_update_group("127.0.0.1", port, 0, 2, "raw", "nccl", torch.device(src_device), is_master=True)
    times = []
    for _ in range(repeat + 1):
        broadcast(group, torch.zeros(1, device=src_device))  # both ends ready
        torch.cuda.synchronize(src_device)
        start = time.perf_counter()
        for _, tensor in tensors:
            broadcast(group, tensor)
        broadcast(group, torch.zeros(1, device=src_device))  # the receiver has everything
        torch.cuda.synchronize(src_device)
        times.append(time.perf_counter() - start)
    helper.join(120)
    return _median(times[1:])


def _raw_receiver(port: int, specs, device: str, rounds: int) -> None:
    from torpor.engine.weight_transfer import broadcast, open_update_group

    torch.cuda.set_device(device)
    group = open_update_group("127.0.0.1", port, 1, 2, "raw", "nccl", torch.device(device))
    buffers = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
    for _ in range(rounds):
        broadcast(group, torch.zeros(1, device=device))
        for buffer in buffers:
            broadcast(group, buffer)
        broadcast(group, torch.zeros(1, device=device))
    torch.cuda.synchronize(device)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_summary(results: dict) -> None:
    serve = results["serve"]
    gib = results["bytes"] / 2**30
    print(f"\n== weights: {gib:.2f} GiB, {results['device']} ==")
    print(f"push (update_weights_from_tensor, trainer process) {serve['push_s']:.4f} s  {serve['push_gbps']:.1f} GB/s"
          f"  (goal ≤ 0.1 s for qwen3-8b)")
    print(f"push, every bucket in one request {serve['push_one_request_s']:.4f} s  "
          f"{results['bytes'] / serve['push_one_request_s'] / GB:.1f} GB/s")
    print(f"push, {serve['buckets']} requests, per request (ms): {format_phases(serve['push_phases_ms_per_request'])}")
    step = serve["rl_step"]
    print(f"RL step: sleep L2 {step['sleep']:.3f} + wake weights {step['wake_weights']:.3f} + push {step['push']:.3f} "
          f"+ wake kv {step['wake_kv']:.3f} = {step['total']:.3f} s  (goal ≤ 0.6 s)")
    print(f"reload_weights (disk) {serve['reload_weights_s']:.3f} s")
    if "in_process" in results:
        ip = results["in_process"]
        print(f"in-process update_weights {ip['update_weights_s']:.4f} s, "
              f"update_weights_from_tensor {ip['update_weights_from_tensor_s']:.4f} s")
        print(f"in-process update_weights_from_tensor per bucket (ms): {format_phases(ip['phases_ms_per_bucket'])}")
    dist = results.get("distributed")
    if dist and "push_s" in dist:
        print(f"NCCL push {dist['push_s']:.4f} s ({dist['push_gbps']:.1f} GB/s) vs raw broadcast "
              f"{dist['raw_broadcast_s']:.4f} s: {100 * dist['fraction_of_raw']:.0f}% (goal ≥ 80%)")
    print(f"answers unchanged after pushing the same weights: {serve['answers_unchanged']}")
