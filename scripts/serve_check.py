"""Drive a real `torpor serve` process over HTTP (httpx only, so it runs where the openai client is not
installed): greedy answers before a sleep, 256 concurrent mixed-length requests sent while asleep and
answered after the wake, the same greedy answers after level-1 and level-2 (+ reload) cycles, and
/memory while asleep. Prints one line per check and exits non-zero on the first failure.

    python scripts/serve_check.py MODEL [--requests 256] [-- extra torpor serve options]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time

import httpx

TOKEN = "serve-check-admin"
MiB = 2**20


def start_server(model: str, port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torpor", "serve", model, "--port", str(port), "--admin-token", TOKEN,
           "--log-level", "warning", *extra]
    print("$", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 400.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server was not healthy after {timeout:.0f} s")


def bare_context_mib() -> float | None:
    """Device memory in use with only a CUDA context and torch (a short-lived process); None without CUDA."""
    code = ("import torch\nif torch.cuda.is_available():\n    torch.zeros(1, device='cuda')\n"
            "    free, total = torch.cuda.mem_get_info()\n    print((total - free) / 2**20)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return float(out.stdout) if out.stdout.strip() else None


def greedy_answers(http: httpx.Client, model: str) -> list[tuple]:
    answers = []
    for prompt in ([1, 2, 3, 4, 5], list(range(100, 400)), "The quick brown fox"):
        body = dict(model=model, prompt=prompt, max_tokens=32, temperature=0, logprobs=2,
                    ignore_eos=True)
        r = http.post("/v1/completions", json=body)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        answers.append((choice["text"], tuple(choice["logprobs"]["token_logprobs"])))
    return answers


async def concurrent_after_wake(url: str, admin: httpx.Client, model: str, num: int) -> tuple[int, float]:
    """`num` mixed requests sent while asleep; the wake comes once all are queued. Returns the number
    answered with exactly their max_tokens and the seconds from the wake to the last answer."""
    rng = random.Random(0)
    jobs = [(rng.randint(4, 1000), rng.randint(8, 200), i % 4 == 0) for i in range(num)]

    async def one(client: httpx.AsyncClient, prompt_len: int, max_tokens: int, stream: bool) -> bool:
        prompt = [rng.randrange(10, 1000) for _ in range(prompt_len)]
        body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.8, seed=prompt_len,
                    ignore_eos=True, stream=stream)
        if not stream:
            r = await client.post("/v1/completions", json=body)
            return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens
        num_chunks = 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                num_chunks += line.startswith("data: {")
        return r.status_code == 200 and num_chunks >= max_tokens

    limits = httpx.Limits(max_connections=num + 8, max_keepalive_connections=num + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        tasks = [asyncio.create_task(one(client, *job)) for job in jobs]
        deadline = time.monotonic() + 60
        while waiting(admin) < num:
            if any(t.done() for t in tasks) or time.monotonic() > deadline:
                raise SystemExit(f"only {waiting(admin):.0f}/{num} requests queued while asleep")
            await asyncio.sleep(0.2)
        start = time.monotonic()
        await asyncio.to_thread(admin.post, "/wake_up")
        results = await asyncio.gather(*tasks)
        return sum(results), time.monotonic() - start


def waiting(admin: httpx.Client) -> float:
    for line in admin.get("/metrics").text.splitlines():
        if line.startswith("torpor_num_requests_waiting "):
            return float(line.split()[1])
    return 0.0


def check(ok: bool, what: str) -> None:
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        raise SystemExit(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--port", type=int, default=8431)
    parser.add_argument("--requests", type=int, default=256)
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    url = f"http://127.0.0.1:{args.port}"
    bare = bare_context_mib()
    proc = start_server(args.model, args.port, extra)
    try:
        print(f"healthy after {wait_healthy(url, proc):.1f} s", flush=True)
        http = httpx.Client(base_url=url, timeout=600)
        admin = httpx.Client(base_url=url, timeout=600, headers={"Authorization": f"Bearer {TOKEN}"})
        model = http.get("/v1/models").json()["data"][0]["id"]
        before = greedy_answers(http, model)
        for level in (1, 2):
            start = time.monotonic()
            admin.post("/sleep", params={"level": level}).raise_for_status()
            sleep_s = time.monotonic() - start
            check(admin.get("/is_sleeping").json() == {"is_sleeping": True}, f"level {level}: is_sleeping")
            used = admin.get("/memory").json()["device_used_bytes"] / MiB
            over = "" if bare is None else f" ({used - bare:+.0f} over a bare context of {bare:.0f} MiB)"
            print(f"     asleep at level {level}: device used {used:.0f} MiB{over}, sleep {sleep_s:.2f} s", flush=True)
            if level == 1:
                answered, seconds = asyncio.run(concurrent_after_wake(url, admin, model, args.requests))
                check(answered == args.requests, f"{answered}/{args.requests} concurrent requests sent while "
                      f"asleep answered in full, {seconds:.1f} s after the wake")
            else:
                admin.post("/wake_up", params={"tags": "weights"}).raise_for_status()
                admin.post("/reload_weights", json={}).raise_for_status()
                admin.post("/wake_up").raise_for_status()
            check(greedy_answers(http, model) == before, f"level {level}: greedy answers and logprobs identical")
        return 0
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    sys.exit(main())
