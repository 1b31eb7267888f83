"""`torpor bench weights`: weights from a trainer process into the engine, measured in one run.

This process is the trainer: it holds the checkpoint's tensors on the device (default: the synthetic qwen3-8b
on a GPU, the tiny model on CPU) and pushes them into a `torpor serve` engine on the same device with
`torpor.rl.WeightPusher` (`update_weights_from_tensor` in flattened buckets: CUDA IPC on a GPU, shared memory on
CPU). Measured:
- the push: seconds and GB/s (median of `--repeat`) with each number of requests in flight of `--in-flight`
  (alternated push by push), the engine's phases per request (as its answers report them) and the trainer's;
  the same pushes with buckets of their own instead of the reused ring; every bucket in one request;
- the RL step: sleep level 2 + wake the weights + push + wake the KV cache;
- side by side: `POST /reload_weights` (from disk), and in this process an `LLM`'s `update_weights` and
  `update_weights_from_tensor` with the same tensors;
- with `--distributed` and 2 GPUs: the engine on GPU 0, the trainer on GPU 1, `update_weights_from_distributed`
  over NCCL (`torpor.rl.DistributedPusher`) against a raw NCCL broadcast of the same bytes between two other
  processes in the same run;
- with `--four-phase` (only this): vLLM's four-phase update over HTTP with the ipc backend (`torpor.rl.vllm_transfer`:
  start, update_weights with one IPC handle per tensor, or vLLM's packed chunks of `--bucket-mb`, finish), seconds
  and GB/s, beside `update_weights_from_tensor` pushes into the same engine, alternated round by round.
The exit code is 1 when the answers changed after pushing the same weights back, or the NCCL part failed.
"""

from __future__ import annotations

import argparse
import time

import torch

from torpor.cli.bench_common import (
    GB,
    Run,
    add_json_option,
    check_json_path,
    console,
    fmt_bytes,
    fmt_rate,
    fmt_s,
    load_tensors,
    median,
    progress,
    resolve_device,
    resolve_model,
    sync,
    table,
    write_json,
)

# The engine's phases of a request (docs/rl.md), in the order they run; the parts timed inside "decode".
PHASE_ORDER = ("decode", "check", "plan", "prepare", "finite", "copy", "buffers", "sync", "state", "release")
PARTS = {"open": "decode", "range": "decode", "views": "decode"}
TRAINER_PHASES = ("bucket", "sync", "serialize", "wait")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("weights", help="weight push from a trainer process: IPC / shared memory / NCCL",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder or preset (default: qwen3-8b on GPU, tiny on CPU)")
    p.add_argument("--device", default="auto")
    p.add_argument("--bucket-mb", type=float, default=512, help="flattened bucket size (MiB; fractions allowed, "
                   "e.g. 0.25 to make the per-bucket costs of a small model visible)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--in-flight", default="1,2,3", help="requests a push keeps in flight, each depth measured "
                   "(alternated push by push); the pusher's default (2), else the last, drives the RL step")
    p.add_argument("--distributed", action="store_true", help="also the NCCL path, trainer on the next GPU")
    p.add_argument("--skip-in-process", action="store_true", help="skip the in-process LLM comparison")
    p.add_argument("--four-phase", action="store_true", help="only vLLM's four-phase update (ipc backend, unpacked "
                   "and packed) beside update_weights_from_tensor, into one engine")
    add_json_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    depths = sorted({int(d) for d in str(args.in_flight).split(",") if d.strip()})
    if not depths or depths[0] < 1 or args.repeat < 1 or args.bucket_mb <= 0:
        raise ValueError(f"--in-flight takes depths >= 1 separated by commas (got {args.in_flight!r}), --repeat a "
                         "count >= 1 and --bucket-mb a size > 0")
    check_json_path(args.json)
    model, label = resolve_model(args.model, device)
    run_ = Run(device, label)
    progress(f"the trainer's tensors: {model} onto {device}")
    tensors = load_tensors(model, device)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    results: dict = {"run": run_.describe(), "bytes": nbytes, "tensors": len(tensors),
                     "bucket_bytes": bucket_bytes(args)}
    if args.four_phase:
        results["four_phase"] = bench_four_phase(model, device, tensors, args)
        report_four_phase(run_, results, args)
        write_json(args.json, results)
        return 0 if results["four_phase"]["answers_unchanged"] else 1
    results["serve"] = bench_serve(model, device, tensors, depths, args)
    if not args.skip_in_process:
        progress("in process: update_weights and update_weights_from_tensor")
        results["in_process"] = bench_in_process(model, device, tensors, args)
    if args.distributed:
        try:  # its first run on two GPUs must not cost the figures measured before it
            results["distributed"] = bench_distributed(model, device, tensors, args)
        except Exception as e:
            results["distributed"] = {"failed": f"{type(e).__name__}: {e}"[-2000:]}
    report(run_, results, args)
    write_json(args.json, results)
    failed = "failed" in results.get("distributed", {})
    return 1 if failed or not results["serve"]["answers_unchanged"] else 0


def bucket_bytes(args: argparse.Namespace) -> int:
    return max(1, int(args.bucket_mb * 2**20))


def serve_args(device: str) -> list[str]:
    args = ["--device", device, "--max-model-len", "2048", "--max-num-seqs", "64"]
    return args + (["--gpu-memory-utilization", "0.35"] if device.startswith("cuda") else [])


def greedy(engine) -> list[int]:
    body = {"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    return engine.post("/v1/completions", json=body)["choices"][0]["token_ids"]


def wait_for_host_reservation(engine, timeout: float = 600.0) -> float:
    """Seconds waited until the engine's background host-copy reservation ended (`GET /memory`): pinning ~16 GB
    for an 8B model takes seconds and stalls the driver calls a push makes, so no timed push overlaps it."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        reservation = engine.http.get("/memory").json().get("host_reservation")
        if reservation is None or reservation.get("done"):
            break
        time.sleep(0.1)
    return time.perf_counter() - start


def bench_serve(model: str, device: str, tensors, depths: list[int], args: argparse.Namespace) -> dict:
    """The engine as a `torpor serve` process on the same device; this process pushes at each depth in turn,
    at the headline depth also with buckets of their own (no reused ring: each request's memory mapped anew)."""
    from torpor.rl import WeightPusher, bucket_named_tensors
    from torpor.rl.engine_process import EngineProcess
    from torpor.rl.weight_sync import DEFAULT_IN_FLIGHT

    headline = DEFAULT_IN_FLIGHT if DEFAULT_IN_FLIGHT in depths else depths[-1]
    size = bucket_bytes(args)
    progress("starting torpor serve")
    with EngineProcess(model, serve_args(device)) as engine:
        waited = wait_for_host_reservation(engine)
        pushers = {d: WeightPusher(engine.url, engine.admin_token, bucket_bytes=size, in_flight=d) for d in depths}
        one_request = WeightPusher(engine.url, engine.admin_token, bucket_bytes=size,
                                   buckets_per_request=1 << 20)  # every bucket in one request (torpor's extension)
        before = greedy(engine)
        for pusher in (*pushers.values(), one_request):
            pusher.push(tensors)  # warm-up: the first IPC opens, the code paths
        pushes: dict[int, list] = {d: [] for d in depths}
        own, single = [], []
        for i in range(args.repeat):
            progress(f"pushes, round {i + 1}/{args.repeat}")
            for d, pusher in pushers.items():
                pushes[d].append(pusher.push(tensors))
            own.append(pushers[headline].push_buckets(bucket_named_tensors(tensors, size)))
            single.append(one_request.push(tensors))
        same = greedy(engine) == before  # the same weights pushed back: the same answers
        steps, step_pushes = [], []
        for i in range(args.repeat):
            progress(f"the RL step, {i + 1}/{args.repeat}")
            sleep = engine.timed("/sleep", params={"level": 2})
            wake_weights = engine.timed("/wake_up", params={"tags": "weights"})
            step_pushes.append(pushers[headline].push(tensors))
            wake_kv = engine.timed("/wake_up", params={"tags": "kv_cache"})
            steps.append({"sleep_s": sleep, "wake_weights_s": wake_weights, "push_s": step_pushes[-1].seconds,
                          "wake_kv_cache_s": wake_kv})
            steps[-1]["total_s"] = sum(steps[-1].values())
        same = same and greedy(engine) == before
        progress("POST /reload_weights")
        reloads = [engine.timed("/reload_weights") for _ in range(min(2, args.repeat))]
        for pusher in (*pushers.values(), one_request):
            pusher.close()
    return {"in_flight": headline, "host_reservation_wait_s": waited,
            "by_in_flight": {d: push_figures(pushes[d]) for d in depths}, "own_buckets": push_figures(own),
            "one_request": push_figures(single), "rl_step": {k: median([s[k] for s in steps]) for k in steps[0]},
            "rl_step_push": push_figures(step_pushes), "reload_weights_s": median(reloads),
            "answers_unchanged": same}


def bench_four_phase(model: str, device: str, tensors, args: argparse.Namespace) -> dict:
    """vLLM's four phases over HTTP into a `torpor serve --weight-transfer-config '{"backend": "ipc"}'` engine, each
    round: one update of every tensor's handle, one of vLLM's packed chunks, one `WeightPusher` push."""
    import json

    from torpor.rl import WeightPusher
    from torpor.rl.engine_process import EngineProcess
    from torpor.rl.vllm_transfer import HTTPWeightTransferClient, ipc_update_info, packed_ipc_update_infos

    size = bucket_bytes(args)
    progress("starting torpor serve (ipc weight transfer)")
    serve = [*serve_args(device), "--weight-transfer-config", json.dumps({"backend": "ipc"})]
    with EngineProcess(model, serve) as engine:
        wait_for_host_reservation(engine)
        client = HTTPWeightTransferClient(engine.url, engine.admin_token)
        pusher = WeightPusher(engine.url, engine.admin_token, bucket_bytes=size)
        client.init_weight_transfer_engine({})

        def four_phase(packed: bool) -> tuple[float, int]:
            sync(device)
            start, chunks = time.perf_counter(), 0
            client.start_weight_update()
            infos = packed_ipc_update_infos(tensors, size) if packed else [ipc_update_info(tensors)]
            for info in infos:  # a packed chunk's buffer is filled again only after its answer
                client.update_weights(info)
                chunks += 1
            client.finish_weight_update()
            return time.perf_counter() - start, chunks

        before = greedy(engine)
        four_phase(False), four_phase(True), pusher.push(tensors)  # warm-up
        unpacked, packed, pushes, chunks = [], [], [], 0
        for i in range(args.repeat):
            progress(f"four-phase updates and pushes, round {i + 1}/{args.repeat}")
            unpacked.append(four_phase(False)[0])
            seconds, chunks = four_phase(True)
            packed.append(seconds)
            pushes.append(pusher.push(tensors).seconds)
        same = greedy(engine) == before
        pusher.close()
        client.close()
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    figures = {name: {"s": median(v), "gbps": nbytes / median(v) / GB}
               for name, v in (("unpacked", unpacked), ("packed", packed), ("from_tensor", pushes))}
    return {**figures, "packed_chunks": chunks, "answers_unchanged": same}


def report_four_phase(run_: Run, r: dict, args: argparse.Namespace) -> None:
    out = console()
    f = r["four_phase"]
    out.print(run_.header())
    out.print(f"the trainer's weights: {r['tensors']} tensors, {fmt_bytes(r['bytes'])}; medians of {args.repeat}")
    rows = [["four-phase, one IPC handle per tensor (one update_weights)", fmt_s(f["unpacked"]["s"]),
             fmt_rate(f["unpacked"]["gbps"] * GB)],
            [f"four-phase, packed ({f['packed_chunks']} chunks of {fmt_bytes(r['bucket_bytes'])})",
             fmt_s(f["packed"]["s"]), fmt_rate(f["packed"]["gbps"] * GB)],
            ["update_weights_from_tensor (WeightPusher)", fmt_s(f["from_tensor"]["s"]),
             fmt_rate(f["from_tensor"]["gbps"] * GB)],
            ["answers after pushing the same weights", "unchanged" if f["answers_unchanged"] else "CHANGED", ""]]
    out.print(table("vLLM's four-phase update (ipc) beside update_weights_from_tensor", ["", "seconds", "rate"], rows))


def push_figures(reports) -> dict:
    """Medians over the pushes: seconds, GB/s, requests, requests staged off the engine thread, and per request
    the engine's phases (its answers'), the engine thread's time in all and idle, and the trainer's parts."""
    push_s = median([p.seconds for p in reports])
    requests = max(reports[0].requests, 1)

    def per_request(values) -> float:
        return median(values) / requests

    engine = [p.engine_phases.get("total", p.engine_seconds) for p in reports]
    names = sorted({n for p in reports for n in p.engine_phases} - {"total"})
    return {"push_s": push_s, "push_gbps": reports[0].bytes / push_s / GB, "requests": reports[0].requests,
            "buckets": reports[0].buckets, "staged": median([p.staged for p in reports]),
            "engine_thread_s_per_request": per_request(engine),
            "engine_idle_s_per_request": per_request([p.seconds - e for p, e in zip(reports, engine, strict=True)]),
            "handler_s_per_request": per_request([p.engine_seconds for p in reports]),
            "engine_phases_s_per_request": {n: per_request([p.engine_phases.get(n, 0.0) for p in reports])
                                            for n in names},
            "trainer_s_per_request": {n: per_request([p.trainer_phases.get(n, 0.0) for p in reports])
                                      for n in TRAINER_PHASES}}


def bench_in_process(model: str, device: str, tensors, args: argparse.Namespace) -> dict:
    """An `LLM` in this process: `update_weights` (per tensor) and `update_weights_from_tensor` (the buckets)."""
    from torpor import LLM
    from torpor.rl import bucket_named_tensors

    llm = LLM(model, device=device, max_model_len=2048, max_num_seqs=64,
              gpu_memory_utilization=0.35 if device.startswith("cuda") else 0.9)
    buckets = list(bucket_named_tensors(tensors, bucket_bytes(args)))
    update, from_tensor = [], []
    try:
        for _ in range(args.repeat + 1):  # the first of each is a warm-up
            sync(device)
            start = time.perf_counter()
            llm.update_weights(tensors)
            sync(device)
            update.append(time.perf_counter() - start)
            start = time.perf_counter()
            for bucket in buckets:
                llm.update_weights_from_tensor(bucket.payload(), load_format="flattened_bucket")
            sync(device)
            from_tensor.append(time.perf_counter() - start)
    finally:
        llm.close()
    return {"update_weights_s": median(update[1:]), "update_weights_from_tensor_s": median(from_tensor[1:]),
            "buckets": len(buckets)}


def bench_distributed(model: str, device: str, tensors, args: argparse.Namespace) -> dict:
    """The engine on `device`, the trainer on the next GPU: `DistributedPusher` against a raw NCCL broadcast."""
    if not device.startswith("cuda") or torch.cuda.device_count() < 2:
        return {"skipped": "needs 2 GPUs"}
    from torpor.rl import DistributedPusher
    from torpor.rl.engine_process import EngineProcess, free_port

    engine_index = torch.device(device).index or 0
    trainer_device = f"cuda:{(engine_index + 1) % torch.cuda.device_count()}"
    moved = [(n, t.to(trainer_device)) for n, t in tensors]
    progress(f"a raw NCCL broadcast, {trainer_device} -> {device}")
    raw = raw_nccl_broadcast([(list(t.shape), t.dtype) for _, t in moved], trainer_device, device, args.repeat)
    progress("update_weights_from_distributed over NCCL")
    with EngineProcess(model, serve_args(device)) as engine:
        wait_for_host_reservation(engine)
        before = greedy(engine)
        pusher = DistributedPusher(engine.url, engine.admin_token, "127.0.0.1", free_port(), trainer_device,
                                   backend="nccl")
        try:
            pusher.push(moved)  # warm-up
            pushes = [pusher.push(moved).seconds for _ in range(args.repeat)]
        finally:
            pusher.close()
        same = greedy(engine) == before
    nbytes = sum(t.numel() * t.element_size() for _, t in moved)
    push_s = median(pushes)
    return {"trainer_device": trainer_device, "push_s": push_s, "push_gbps": nbytes / push_s / GB,
            "raw_broadcast_s": raw, "raw_broadcast_gbps": nbytes / raw / GB, "fraction_of_raw": raw / push_s,
            "answers_unchanged": same}


def raw_nccl_broadcast(specs, src_device: str, dst_device: str, repeat: int, timeout: float = 300) -> float:
    """Median seconds to broadcast tensors of `specs` (shape, dtype), in order, from a process on `src_device` to
    one on `dst_device` over a plain torch.distributed NCCL group: the link's own figure."""
    import multiprocessing

    from torpor.rl.engine_process import free_port

    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_raw_rank, args=(rank, port, specs, dev, repeat + 1, answers), daemon=True)
             for rank, dev in enumerate((src_device, dst_device))]
    for process in ranks:
        process.start()
    try:
        return answers.get(timeout=timeout)
    except Exception:
        raise RuntimeError(f"the raw NCCL broadcast between {src_device} and {dst_device} did not answer within "
                           f"{timeout:.0f} s") from None
    finally:
        for process in ranks:
            process.join(30)
            if process.is_alive():
                process.kill()


def _raw_rank(rank: int, port: int, specs, device: str, rounds: int, answers) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buffers = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
    flag = torch.zeros(1, device=device)
    times = []
    for _ in range(rounds):
        dist.broadcast(flag, src=0)  # both ends ready
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for buffer in buffers:
            dist.broadcast(buffer, src=0)
        dist.broadcast(flag, src=0)  # the receiver has everything
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    if rank == 0:
        answers.put(median(times[1:]))
    dist.destroy_process_group()


def phase_rows(names: set[str]) -> list[tuple[str, str]]:
    """(phase, label) in the order a request runs them: the engine thread's phases, each followed by its parts,
    then the staging thread's ("stage": its time in all; "stage_decode", ...), then any phase not known here."""
    rows: list[tuple[str, str]] = []
    for prefix in ("", "stage_"):
        if prefix and "stage" in names:
            rows.append(("stage", "staging thread, in all"))
        for phase in PHASE_ORDER:
            if prefix + phase in names:
                rows.append((prefix + phase, prefix + phase))
                rows += [(prefix + part, f"  {prefix}{part} (in {prefix}{phase})") for part, whole in PARTS.items()
                         if whole == phase and prefix + part in names]
    return rows + [(n, n) for n in sorted(names - {name for name, _ in rows})]


def report(run_: Run, r: dict, args: argparse.Namespace) -> None:
    out = console()
    serve = r["serve"]
    out.print(run_.header())
    out.print(f"the trainer's weights: {r['tensors']} tensors, {fmt_bytes(r['bytes'])}, buckets of "
              f"{fmt_bytes(r['bucket_bytes'])}; medians of {args.repeat}; waited "
              f"{fmt_s(serve['host_reservation_wait_s'])} for the engine's host-copy reservation before timing")
    cases = {f"{d} in flight": f for d, f in serve["by_in_flight"].items()}
    cases[f"{serve['in_flight']} in flight, buckets of their own"] = serve["own_buckets"]
    cases["every bucket in one request"] = serve["one_request"]
    cases[f"{serve['in_flight']} in flight, in the RL step"] = serve["rl_step_push"]
    goal = run_.goal("<= 100 ms")
    rows = [[name, fmt_s(f["push_s"]), fmt_rate(f["push_gbps"] * GB), str(f["requests"]), f"{f['staged']:g}",
             goal if name == f"{serve['in_flight']} in flight" else ""] for name, f in cases.items()]
    out.print(table("push from the trainer process (update_weights_from_tensor)",
                    ["push", "seconds", "rate", "requests", "staged off the engine thread", "goal"], rows))
    phases = {n for f in cases.values() for n in f["engine_phases_s_per_request"]}
    rows = [[label, *(fmt_s(f["engine_phases_s_per_request"].get(name)) for f in cases.values())]
            for name, label in phase_rows(phases)]
    rows += [["engine thread, in all", *(fmt_s(f["engine_thread_s_per_request"]) for f in cases.values())],
             ["engine thread idle", *(fmt_s(f["engine_idle_s_per_request"]) for f in cases.values())],
             ["handler latency", *(fmt_s(f["handler_s_per_request"]) for f in cases.values())]]
    rows += [[f"trainer: {n}", *(fmt_s(f["trainer_s_per_request"][n]) for f in cases.values())]
             for n in TRAINER_PHASES]
    out.print(table("per request: the engine's phases (stage_*: off its thread), the trainer's", ["", *cases], rows))
    step = serve["rl_step"]
    rows = [["sleep level 2", fmt_s(step["sleep_s"]), ""], ["wake the weights", fmt_s(step["wake_weights_s"]), ""],
            [f"push ({serve['in_flight']} in flight)", fmt_s(step["push_s"]), ""],
            ["wake the KV cache", fmt_s(step["wake_kv_cache_s"]), ""],
            ["the RL step", fmt_s(step["total_s"]), run_.goal("<= 600 ms")],
            ["POST /reload_weights (from disk)", fmt_s(serve["reload_weights_s"]), ""]]
    if "in_process" in r:
        ip = r["in_process"]
        rows += [["in process: update_weights", fmt_s(ip["update_weights_s"]), ""],
                 [f"in process: update_weights_from_tensor ({ip['buckets']} buckets, no IPC)",
                  fmt_s(ip["update_weights_from_tensor_s"]), ""]]
    rows.append(["answers after pushing the same weights", "unchanged" if serve["answers_unchanged"] else "CHANGED",
                 ""])
    out.print(table("the RL step and the other ways in", ["", "seconds", "goal"], rows))
    dist = r.get("distributed")
    if dist and "push_s" in dist:
        out.print(table(f"NCCL, trainer on {dist['trainer_device']}", ["", "seconds", "rate", "goal"], [
            ["update_weights_from_distributed", fmt_s(dist["push_s"]), fmt_rate(dist["push_gbps"] * GB), ""],
            ["raw NCCL broadcast of the same bytes", fmt_s(dist["raw_broadcast_s"]),
             fmt_rate(dist["raw_broadcast_gbps"] * GB), ""],
            ["push against raw", f"{dist['fraction_of_raw']:.0%}", "", run_.goal(">= 80%")],
            ["answers unchanged", str(dist["answers_unchanged"]), "", ""]]))
    elif dist:
        out.print(f"NCCL: {dist.get('failed') or dist.get('skipped')}")
