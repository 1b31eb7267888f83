"""The latency of a small request while clients flood a `torpor serve` with 1 MB prompts.

Starts `torpor serve` in a subprocess (the torpor on PYTHONPATH), then `--clients` threads post prompts of
`--prompt-mb` MB to /v1/completions as fast as the server answers (each is refused: too long for the
context), while the main thread times one-token completions and `GET /health`, one after another. Prints
their p50 / p90 / max, and the same without the flood.

`--long-token N` gives the tokenizer a vocabulary entry of N characters (a copy of the model): real
vocabularies hold long tokens (runs of spaces or dashes), which raise the length bound above 1 MB, so the
prompts are then tokenized (off the event loop) before their token count refuses them.

    python scripts/bench_prompt_flood.py                       # the embedded tiny model, max_model_len 4096
    python scripts/bench_prompt_flood.py --long-token 300      # prompts tokenized, then refused
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


def with_long_token(model: Path, length: int, folder: Path) -> Path:
    """A copy of `model` whose tokenizer's last vocabulary entry spells `length` characters."""
    copy = folder / "long-token"
    shutil.copytree(model, copy)
    spec = json.loads((copy / "tokenizer.json").read_text())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    used = {part for merge in merges for part in (merge.split(" ") if isinstance(merge, str) else merge)}
    leaf = next(token for token, token_id in sorted(vocab.items(), key=lambda kv: -kv[1])
                if token not in used and token_id < 1021)
    token_id = vocab.pop(leaf)
    vocab["=" * length] = token_id
    spec["model"]["merges"] = [m for m in merges if "".join(m.split(" ") if isinstance(m, str) else m) != leaf]
    spec["added_tokens"].append({"id": token_id, "content": "=" * length, "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": False})
    (copy / "tokenizer.json").write_text(json.dumps(spec))
    return copy


def percentiles(values: list[float]) -> str:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]
    return f"p50 {statistics.median(ordered) * 1e3:8.1f} ms   p90 {p90 * 1e3:8.1f} ms   max {ordered[-1] * 1e3:8.1f} ms"


def measure(url: str, count: int) -> tuple[list[float], list[float]]:
    completions, health = [], []
    with httpx.Client(base_url=url, timeout=120) as http:
        for _ in range(count):
            start = time.perf_counter()
            http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).raise_for_status()
            completions.append(time.perf_counter() - start)
            start = time.perf_counter()
            http.get("/health").raise_for_status()
            health.append(time.perf_counter() - start)
    return completions, health


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--prompt-mb", type=float, default=1.0)
    parser.add_argument("--requests", type=int, default=30, help="timed completions (and /health calls)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--long-token", type=int, default=0)
    args = parser.parse_args()

    from torpor.rl.engine_process import free_port
    from torpor.synthetic import make_model

    folder = Path(tempfile.mkdtemp(prefix="prompt-flood-"))
    model = make_model("tiny", folder / "tiny", dtype="float32", progress=False)
    if args.long_token:
        model = with_long_token(Path(model), args.long_token, folder)
    port = free_port()
    body_limit = int(args.prompt_mb * (1 << 20)) + (1 << 16)
    server = subprocess.Popen([sys.executable, "-m", "torpor.cli.main", "serve", str(model), "--port", str(port),
                               "--device", "cpu", "--dtype", "float32", "--max-model-len", str(args.max_model_len),
                               "--max-body-bytes", str(body_limit), "--log-level", "warning"],
                              env={**os.environ}, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.2)
        measure(url, 3)  # warm up
        quiet = measure(url, args.requests)
        prompt = "hello world " * int(args.prompt_mb * (1 << 20) / 12)
        stop, statuses = threading.Event(), []

        def flood() -> None:
            with httpx.Client(base_url=url, timeout=300) as http:
                while not stop.is_set():
                    statuses.append(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code)

        clients = [threading.Thread(target=flood, daemon=True) for _ in range(args.clients)]
        for client in clients:
            client.start()
        time.sleep(1.0)
        loaded = measure(url, args.requests)
        stop.set()
        for client in clients:
            client.join(300)
        print(f"{args.clients} clients x {args.prompt_mb:g} MB prompts, max_model_len {args.max_model_len}, "
              f"long token {args.long_token or 'none'}: {len(statuses)} flood requests answered "
              f"{sorted(set(statuses))}")
        print(f"  1-token completion, quiet:   {percentiles(quiet[0])}")
        print(f"  1-token completion, flooded: {percentiles(loaded[0])}")
        print(f"  GET /health, quiet:          {percentiles(quiet[1])}")
        print(f"  GET /health, flooded:        {percentiles(loaded[1])}")
    finally:
        server.terminate()
        server.wait(30)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
