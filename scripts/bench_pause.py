"""Pause / resume latency with `--requests` requests running (vLLM's `pause_generation` / `resume_generation`):
milliseconds each way, measured three ways on the same engine:

- `engine`: `LLMEngine.pause_generation` / `resume_generation` called between two steps (the state change alone);
- `server`: `AsyncEngine.pause_generation` awaited while its engine thread decodes (includes the wait for the step
  in flight, which a pause must not interrupt);
- `http`: `POST /pause` and `POST /resume` to an in-process server (uvicorn, the whole stack).

The goal on a GPU: <= 5 ms each way with 512 requests. Modes: `keep` with `--clear-cache` (vLLM's default: the
running requests go back to the queue, recomputed after the resume) or without (frozen with their KV), `abort`
(the requests end; new ones are added for each round).

    python scripts/bench_pause.py                                    # tiny model on CPU, 512 requests
    python scripts/bench_pause.py --device cuda --model qwen3-0.6b   # on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx

from torpor.cli.bench_common import resolve_device, resolve_model
from torpor.engine import LLM, SamplingParams
from torpor.server import ServerConfig, build_app

ADMIN = "bench-admin"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="a preset (default: tiny on CPU, qwen3-0.6b on CUDA) or folder")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--mode", default="keep", choices=("keep", "abort"))
    parser.add_argument("--clear-cache", action="store_true", help="keep: recompute the running requests (vLLM's "
                        "default); without it they keep their KV")
    args = parser.parse_args()
    device = resolve_device(args.device)
    path, label = resolve_model(args.model, device, gpu_default="qwen3-0.6b")
    llm = LLM(path, device=device, max_num_seqs=args.requests, max_model_len=256,
              max_num_batched_tokens=max(2048, 8 * args.requests))
    print(f"{label} on {device}, {args.requests} requests running, mode {args.mode}"
          f"{', clear_cache' if args.clear_cache else ''}; ms per call: median (min-max) of {args.rounds}")
    report("engine", bench_engine(llm.engine, args))
    report("server", asyncio.run(bench_server(llm.engine, args)))
    report("http", bench_http(llm.engine, args))


def params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def prompts(n: int, salt: int) -> list[list[int]]:
    return [[1 + (salt * 7 + i) % 500, 2 + i % 300, 3] for i in range(n)]


def bench_engine(engine, args) -> tuple[list[float], list[float]]:
    pauses, resumes, steps = [], [], []
    for r in range(args.rounds):
        if not engine.scheduler.running:
            for i, prompt in enumerate(prompts(args.requests, r)):
                engine.add_request(prompt, params(), f"e{r}-{i}")
        while len(engine.scheduler.running) < args.requests:
            engine.step()
        step = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - step)
        start = time.perf_counter()
        engine.pause_generation(args.mode, args.clear_cache)
        middle = time.perf_counter()
        engine.resume_generation()
        pauses.append(middle - start)
        resumes.append(time.perf_counter() - middle)
    engine.abort_requests(None)
    engine.step()
    print(f"  a decode step of {args.requests}: {statistics.median(steps) * 1e3:.2f} ms (a pause on the server waits "
          "for the step in flight)")
    return pauses, resumes


async def bench_server(engine, args) -> tuple[list[float], list[float]]:
    from torpor.server.async_engine import AsyncEngine

    served = AsyncEngine(engine)
    served.start()
    pauses, resumes = [], []
    try:
        for r in range(args.rounds):
            await _fill(served, args.requests, f"s{r}")
            start = time.perf_counter()
            await served.pause_generation(args.mode, args.clear_cache)
            middle = time.perf_counter()
            await served.resume_generation()
            pauses.append(middle - start)
            resumes.append(time.perf_counter() - middle)
        await served.abort_requests(None)
    finally:
        served.stop()
    return pauses, resumes


async def _fill(served, n: int, tag: str) -> None:
    """`n` requests running (added when the last round aborted them)."""
    if served.state.num_running < n:
        for i, prompt in enumerate(prompts(n, hash(tag) % 97)):
            await served.add_request(f"{tag}-{i}", prompt, params())
    while (await served.stats())["num_running"] < n:
        await asyncio.sleep(0.001)


def bench_http(engine, args) -> tuple[list[float], list[float]]:
    from server_thread import ServerThread  # tests/: the same in-process server the HTTP tests use

    app = build_app(engine, ServerConfig("bench", admin_token=ADMIN))
    pauses, resumes = [], []
    with ServerThread(app) as url, httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}) as http:
        served = app.state.server.engine
        query = {"mode": args.mode, "clear_cache": args.clear_cache}
        for r in range(args.rounds):
            asyncio.run_coroutine_threadsafe(_fill(served, args.requests, f"h{r}"), served._loop).result(300)
            start = time.perf_counter()
            http.post("/pause", params=query).raise_for_status()
            middle = time.perf_counter()
            http.post("/resume").raise_for_status()
            pauses.append(middle - start)
            resumes.append(time.perf_counter() - middle)
        http.post("/abort_requests", json={}).raise_for_status()
    return pauses, resumes


def report(what: str, times: tuple[list[float], list[float]]) -> None:
    def ms(values: list[float]) -> str:
        values = [v * 1e3 for v in values]
        return f"{statistics.median(values):7.2f} ({min(values):.2f}-{max(values):.2f})"

    pauses, resumes = times
    print(f"  {what:<7} pause {ms(pauses)}   resume {ms(resumes)}")


if __name__ == "__main__":
    main()
