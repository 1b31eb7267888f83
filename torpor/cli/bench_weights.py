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
    p.add_argument("--in-flight", default="1,2,3", help="requests a push keeps in flight, each depth measured "
                   "(alternated push by push); the pusher's default (2) or else the last drives the headline and the "
                   "RL step (default 1,2,3)")
    p.add_argument("--distributed", action="store_true", help="also the NCCL path, trainer on the next GPU")
    p.add_argument("--skip-in-process", action="store_true", help="skip the in-process LLM comparison")
    p.add_argument("--json", default=None, help="also write the results here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from torpor.cli.bench_sleep import resolve_model
    from torpor.engine.llm import _resolve_device
    from torpor.engine.weights.loader import iter_checkpoint

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
        try:  # its first run on two GPUs must not cost the figures measured before it
            results["distributed"] = bench_distributed(model, device, tensors, args)
        except Exception as e:
            results["distributed"] = {"failed": f"{type(e).__name__}: {e}"[-2000:]}
            print(f"distributed: failed: {results['distributed']['failed']}", flush=True)
    print_summary(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 1 if "failed" in results.get("distributed", {}) else 0


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


def _depths(args: argparse.Namespace) -> list[int]:
    depths = [int(d) for d in str(args.in_flight).split(",") if d.strip()]
    if not depths or min(depths) < 1:
        raise ValueError(f"--in-flight takes depths >= 1 separated by commas, got {args.in_flight!r}")
    return depths


def _headline_depth(depths: list[int]) -> int:
    """The depth the headline figures and the RL step use: the pusher's default when measured, else the last."""
    from torpor.rl.weight_sync import DEFAULT_IN_FLIGHT

    return DEFAULT_IN_FLIGHT if DEFAULT_IN_FLIGHT in depths else depths[-1]


def wait_for_host_reservation(engine, timeout: float = 600.0) -> float:
    """Seconds waited until the engine's background host-copy reservation ended (pinning ~16 GB for an 8B model
    takes seconds and may stall the driver calls a push makes: measured pushes must not overlap it)."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        reservation = engine.http.get("/memory").json().get("host_reservation")
        if reservation is None or reservation.get("done"):
            break
        time.sleep(0.1)
    return time.perf_counter() - start


def bench_serve(model: str, device: str, tensors, args) -> dict:
    """The engine as a `torpor serve` process on the same device; this process pushes, with each in-flight
    depth of `--in-flight` in turn (alternated, so drifting load hits every depth alike), and at the headline depth
    also with buckets of their own (`push_buckets`: no reused buffers, each request's memory mapped anew)."""
    from torpor.rl import WeightPusher, bucket_named_tensors
    from torpor.rl.engine_process import EngineProcess

    depths = _depths(args)
    with EngineProcess(model, _serve_args(device)) as engine:
        waited = wait_for_host_reservation(engine)
        print(f"serve: waited {waited:.2f} s for the engine's host-copy reservation to end", flush=True)
        pushers = {d: WeightPusher(engine.url, engine.admin_token, bucket_bytes=_bucket_bytes(args), in_flight=d)
                   for d in depths}
        headline = _headline_depth(depths)
        pusher = pushers[headline]
        before = _greedy(engine)
        for p in pushers.values():
            p.push(tensors)  # warm-up (first IPC opens, code paths)
        pushes: dict[int, list] = {d: [] for d in depths}
        own: list = []
        for _ in range(args.repeat):
            for d, p in pushers.items():
                pushes[d].append(p.push(tensors))
            own.append(pusher.push_buckets(bucket_named_tensors(tensors, _bucket_bytes(args))))
        one_request = WeightPusher(engine.url, engine.admin_token, bucket_bytes=_bucket_bytes(args),
                                   buckets_per_request=1 << 20)  # every bucket in one request (torpor's extension)
        one_request.push(tensors)
        single = [one_request.push(tensors).seconds for _ in range(args.repeat)]
        same = _greedy(engine) == before  # the same weights pushed back: the same answers
        steps, step_pushes = [], []
        for _ in range(args.repeat):
            sleep = engine.timed("/sleep", params={"level": 2})
            wake_weights = engine.timed("/wake_up", params={"tags": "weights"})
            step_pushes.append(pusher.push(tensors))
            push = step_pushes[-1].seconds
            wake_kv = engine.timed("/wake_up", params={"tags": "kv_cache"})
            steps.append({"sleep": sleep, "wake_weights": wake_weights, "push": push, "wake_kv": wake_kv,
                          "total": sleep + wake_weights + push + wake_kv})
        after_cycle = _greedy(engine) == before
        reloads = [engine.timed("/reload_weights") for _ in range(min(2, args.repeat))]
        for p in (*pushers.values(), one_request):
            p.close()
    by_depth = {d: _push_figures(pushes[d]) for d in depths}
    main = by_depth[headline]
    result = {**main, "in_flight": headline, "by_in_flight": by_depth, "host_reservation_wait_s": waited,
              "rl_step": {k: _median([s[k] for s in steps]) for k in steps[0]},
              "reload_weights_s": _median(reloads), "answers_unchanged": same and after_cycle,
              "push_one_request_s": _median(single), "own_buckets": _push_figures(own),
              "rl_step_push": _push_figures(step_pushes)}
    for d, figures in by_depth.items():
        print(f"serve push, {d} in flight: {figures['push_s']:.4f} s ({figures['push_gbps']:.1f} GB/s, "
              f"{figures['buckets']} buckets, {figures['staged']:g} of {figures['requests']} requests staged off the "
              f"engine thread; the engine thread busy {figures['push_engine_s']:.4f} s of it)")
        print(f"serve push, {d} in flight, per request: {format_phases(figures['push_phases_ms_per_request'])}")
        trainer = figures["trainer_ms_per_request"]
        print(f"serve push, {d} in flight, the trainer per request (ms): "
              + " + ".join(f"{name} {ms:.3f}" for name, ms in trainer.items()))
    figures = result["own_buckets"]
    print(f"serve push, {headline} in flight, buckets of their own (no reused buffers): {figures['push_s']:.4f} s; "
          f"per request: {format_phases(figures['push_phases_ms_per_request'])}")
    figures = result["rl_step_push"]
    print(f"serve push in the RL step (right after the weights' wake), {headline} in flight: "
          f"{figures['push_s']:.4f} s; "
          f"per request: {format_phases(figures['push_phases_ms_per_request'])}; the trainer per request (ms): "
          + " + ".join(f"{name} {ms:.3f}" for name, ms in figures["trainer_ms_per_request"].items()))
    print(f"RL step {result['rl_step']}; reload_weights {result['reload_weights_s']:.3f} s; "
          f"answers unchanged: {result['answers_unchanged']}")
    return result


def _push_figures(reports) -> dict:
    push_s = _median([p.seconds for p in reports])
    return {"push_s": push_s, "push_gbps": reports[0].bytes / push_s / GB, "buckets": reports[0].buckets,
            "requests": reports[0].requests, "staged": _median([p.staged for p in reports]),
            "push_engine_s": _median([p.engine_phases.get("total", p.engine_seconds) for p in reports]),
            "push_phases_ms_per_request": phases_per_request(reports),
            "trainer_ms_per_request": {name: _median([r.trainer_phases.get(name, 0.0) * 1e3 / max(r.requests, 1)
                                                      for r in reports])
                                       for name in ("bucket", "sync", "serialize", "wait")}}


def phases_per_request(reports) -> dict[str, float]:
    """Median milliseconds per request of each engine phase (`PushReport.engine_phases`): the engine thread's
    phases, "other" (its time in no phase) and "engine" (its time in all); the staging thread's ("stage_decode",
    ..., "stage": a request's time there, averaged over every request, staged or not; only requests that found
    another in flight are staged); "idle" (the push's time per request the engine thread did not spend on it:
    bucketing, pickling, HTTP, the staging not overlapped), "handler" (a request's latency in the server) and
    "push" (the whole push per request)."""
    names = sorted({name for r in reports for name in r.engine_phases} - {"total"})
    per = {name: _median([r.engine_phases.get(name, 0.0) * 1e3 / max(r.requests, 1) for r in reports])
           for name in names}
    total = _median([r.engine_phases.get("total", r.engine_seconds) * 1e3 / max(r.requests, 1) for r in reports])
    per["other"] = max(0.0, total - sum(v for n, v in per.items() if _phase_of(n) == n and not n.startswith("stage")))
    per["engine"] = total
    per["idle"] = _median([(r.seconds - r.engine_phases.get("total", r.engine_seconds)) * 1e3 / max(r.requests, 1)
                           for r in reports])
    per["handler"] = _median([r.engine_seconds * 1e3 / max(r.requests, 1) for r in reports])
    per["push"] = _median([r.seconds * 1e3 / max(r.requests, 1) for r in reports])
    return per


PHASE_ORDER = ("decode", "check", "plan", "prepare", "finite", "copy", "buffers", "sync", "state",
               "release", "other")
SUMMARY = ("engine", "idle", "handler", "push", "stage")
# Parts of "decode" (timed inside it, so not added again): the mapped files or opened IPC handles, the CUDA IPC
# range checks, the bucket's views.
SUBPHASES = {"open": "decode", "range": "decode", "views": "decode"}


def _phase_of(name: str) -> str:
    """The phase `name` is counted in: itself, or the phase it is part of ("open" -> "decode")."""
    prefix = "stage_" if name.startswith("stage_") else ""
    base = name.removeprefix(prefix)
    return prefix + SUBPHASES[base] if base in SUBPHASES else name


def format_phases(per: dict[str, float]) -> str:
    """'decode 0.31 + check 0.02 + ... = engine 1.20 ms; staged off the engine thread: ...; idle 0.80 ms; ...'
    (known phases first)."""
    engine = [n for n in per if not n.startswith("stage") and n not in SUMMARY and _phase_of(n) == n]
    names = [n for n in PHASE_ORDER if n in engine] + sorted(set(engine) - set(PHASE_ORDER))
    text = " + ".join(_with_parts(per, n) for n in names) + f" = engine thread {per.get('engine', 0.0):.3f} ms"
    staged = [n for n in per if n.startswith("stage_") and _phase_of(n) == n]
    if staged:
        text += ("; staged off the engine thread: " + " + ".join(_with_parts(per, n, "stage_") for n in sorted(staged))
                 + f" = stage {per.get('stage', 0.0):.3f} ms")
    if "push" in per:
        text += (f"; engine thread idle {per['idle']:.3f} ms; handler latency {per['handler']:.3f} ms; "
                 f"whole push {per['push']:.3f} ms")
    return text


def _with_parts(per: dict[str, float], name: str, prefix: str = "") -> str:
    """'decode 2.40 (open 0.27, views 0.20)': a phase with the parts timed inside it."""
    parts = [n for n in per if n != name and _phase_of(n) == name]
    inner = f" ({', '.join(f'{n.removeprefix(prefix)} {per[n]:.3f}' for n in sorted(parts))})" if parts else ""
    return f"{name.removeprefix(prefix)} {per[name]:.3f}{inner}"


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
    for key in ("idle", "handler", "push"):
        result["phases_ms_per_bucket"].pop(key)
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
    from torpor.rl.engine_process import EngineProcess, free_port

    engine_index = torch.device(device).index or 0
    trainer_device = f"cuda:{(engine_index + 1) % torch.cuda.device_count()}"
    moved = [(n, t.to(trainer_device)) for n, t in tensors]
    raw = raw_nccl_broadcast(moved, trainer_device, device, args.repeat)
    with EngineProcess(model, _serve_args(device)) as engine:
        wait_for_host_reservation(engine)  # its pinning stalls the driver calls a push makes
        before = _greedy(engine)
        pusher = DistributedPusher(engine.url, engine.admin_token, "127.0.0.1", free_port(), trainer_device,
                                   backend="nccl")
        try:
            pusher.push(moved)  # warm-up
            pushes = [pusher.push(moved).seconds for _ in range(args.repeat)]
        finally:
            pusher.close()
        same = _greedy(engine) == before  # the same weights broadcast back: the same answers
    nbytes = sum(t.numel() * t.element_size() for _, t in moved)
    push_s = _median(pushes)
    result = {"push_s": push_s, "push_gbps": nbytes / push_s / GB, "raw_broadcast_s": raw,
              "raw_broadcast_gbps": nbytes / raw / GB, "fraction_of_raw": raw / push_s, "answers_unchanged": same}
    print(f"distributed (NCCL, {trainer_device} -> {device}): push {push_s:.4f} s ({result['push_gbps']:.1f} GB/s); "
          f"raw broadcast {raw:.4f} s ({result['raw_broadcast_gbps']:.1f} GB/s); {100 * raw / push_s:.0f}% of raw; "
          f"answers unchanged: {same}")
    return result


def raw_nccl_broadcast(tensors, src_device: str, dst_device: str, repeat: int) -> float:
    """Median seconds to broadcast `tensors` (in order) from this process to a helper process on
    `dst_device`, over the same kind of standalone group: the link's own figure."""
    import multiprocessing

    from torpor.engine.weights.transport import broadcast, open_update_group
    from torpor.rl.engine_process import free_port

    port = free_port()
    specs = [(list(t.shape), t.dtype) for _, t in tensors]
    context = multiprocessing.get_context("spawn")
    helper = context.Process(target=_raw_receiver, args=(port, specs, dst_device, repeat + 1), daemon=True)
    helper.start()
    group = open_update_group("127.0.0.1", port, 0, 2, "raw", "nccl", torch.device(src_device))
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
    from torpor.engine.weights.transport import broadcast, open_update_group

    torch.cuda.set_device(device)
    group = open_update_group("127.0.0.1", port, 1, 2, "raw", "nccl", torch.device(device))
    buffers = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
    for _ in range(rounds):
        broadcast(group, torch.zeros(1, device=device))
        for buffer in buffers:
            broadcast(group, buffer)
        broadcast(group, torch.zeros(1, device=device))
    torch.cuda.synchronize(device)


def print_summary(results: dict) -> None:
    serve = results["serve"]
    gib = results["bytes"] / 2**30
    print(f"\n== weights: {gib:.2f} GiB, {results['device']} ==")
    print(f"push (update_weights_from_tensor, trainer process, {serve['in_flight']} in flight) {serve['push_s']:.4f} s"
          f"  {serve['push_gbps']:.1f} GB/s  (goal ≤ 0.1 s for qwen3-8b)")
    for depth, figures in serve["by_in_flight"].items():
        print(f"push, {figures['requests']} requests, {depth} in flight ({figures['staged']:g} staged): "
              f"{figures['push_s']:.4f} s; per request (ms): {format_phases(figures['push_phases_ms_per_request'])}")
    print(f"push, {serve['in_flight']} in flight, buckets of their own (each request's memory mapped anew): "
          f"{serve['own_buckets']['push_s']:.4f} s")
    print(f"push, every bucket in one request {serve['push_one_request_s']:.4f} s  "
          f"{results['bytes'] / serve['push_one_request_s'] / GB:.1f} GB/s")
    print(f"(waited {serve['host_reservation_wait_s']:.2f} s for the engine's host-copy reservation before timing)")
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
              f"{dist['raw_broadcast_s']:.4f} s: {100 * dist['fraction_of_raw']:.0f}% (goal ≥ 80%); answers unchanged: "
              f"{dist['answers_unchanged']}")
    print(f"answers unchanged after pushing the same weights: {serve['answers_unchanged']}")
