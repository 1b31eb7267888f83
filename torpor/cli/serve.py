"""`torpor serve`: an OpenAI-compatible HTTP server with a sleep/wake control plane.

Inference: POST /v1/completions, POST /v1/chat/completions (both with "stream": true),
GET /v1/models, GET /health, GET /metrics (Prometheus).
Control plane (needs 'Authorization: Bearer ADMIN_TOKEN'; off without --admin-token):
POST /sleep?level=0|1|2&mode=wait|abort, POST /wake_up?tags=weights&tags=kv_cache, GET /is_sleeping,
POST /reload_weights {"path": ...}, GET /memory, POST /collective_rpc {"method": ..., "kwargs": {...}},
POST /release_memory_occupation and /resume_memory_occupation {"tags": [...]}.
Requests that arrive while the engine sleeps wait for the wake (or get 503 after --asleep-timeout).
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import time

EXIT_CODES = """exit codes:
  0  stopped cleanly (SIGINT / SIGTERM)
  1  the engine could not start (model, device or memory), or the server failed
  2  bad command-line arguments
  3  cannot listen on HOST:PORT (in use, or not an address of this machine)"""
EXIT_ENGINE, EXIT_LISTEN = 1, 3


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API with sleep/wake control",
                       description=__doc__, epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="Hugging Face checkpoint folder (default: the embedded tiny model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=port_number, default=8000, help="TCP port (default: 8000; 0 picks a free one)")
    p.add_argument("--served-model-name", default=None,
                   help="model id in /v1/models and requests (default: the checkpoint folder's name)")
    engine = p.add_argument_group("engine")
    engine.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    engine.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                        help="weight dtype (default: the checkpoint's)")
    engine.add_argument("--max-model-len", type=positive_int, default=None,
                        help="prompt + output tokens of one request (default: min(4096, the model's limit))")
    engine.add_argument("--max-num-seqs", type=positive_int, default=256, help="requests running at once")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of device memory the engine may use (default: 0.9)")
    engine.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    engine.add_argument("--tensor-parallel-size", "--tp", type=positive_int, default=1, metavar="N",
                        help="split the model over N processes, one device each (default: 1). On GPU, rank r "
                             "uses the device r places after --device (cuda:0..cuda:N-1 by default; "
                             "CUDA_VISIBLE_DEVICES chooses them), over NCCL; on CPU, N processes over gloo. "
                             "Heads, kv heads, intermediate size and vocabulary must divide by N. Sleep, wake "
                             "and weight updates reach every rank")
    engine.add_argument("--seed", type=int, default=0, help="seeds requests that give no seed (default: 0)")
    security = p.add_argument_group("security and limits")
    security.add_argument("--admin-token", default=None,
                          help="bearer token of the control plane; without one it answers 403 (env: "
                               "TORPOR_ADMIN_TOKEN, preferred: options are visible in the process list)")
    security.add_argument("--api-key", default=None,
                          help="bearer token the inference endpoints require (env: TORPOR_API_KEY; default: open)")
    security.add_argument("--max-body-bytes", type=positive_int, default=1 << 20,
                          help="larger request bodies get 413 (default: 1 MiB)")
    security.add_argument("--max-tokens-cap", type=positive_int, default=None,
                          help="larger max_tokens get 400 (default: max-model-len)")
    security.add_argument("--allowed-weights-dir", default=None, metavar="DIR",
                          help="POST /reload_weights {\"path\"} reads only inside DIR (symlinks resolved; other "
                               "paths get 403). Default: the served model's parent folder")
    security.add_argument("--asleep-timeout", type=seconds, default=None,
                          help="seconds a request waits for a sleeping engine before 503 (default: until the "
                               "wake); per request: the X-Asleep-Timeout header")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="server log level (default: info)")
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from torpor.env import Env

    env = Env.read()
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        _say(f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
        return EXIT_LISTEN
    llm = _load_engine(args)
    if llm is None:
        sock.close()
        return EXIT_ENGINE
    return _serve(args, llm, sock, admin_token=args.admin_token or env.admin_token,
                  api_key=args.api_key or env.api_key)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port, not listening yet (connections are refused, not left hanging,
    until the server starts). Raises OSError."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _load_engine(args: argparse.Namespace):
    from torpor.engine import LLM

    tp = args.tensor_parallel_size
    ranks = f", tensor parallel over {tp} ranks" if tp > 1 else ""
    _say(f"loading {args.model or 'the embedded tiny model'} (device {args.device}, dtype {args.dtype}{ranks}) ...")
    start = time.perf_counter()
    try:
        llm = LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
                  enforce_eager=args.enforce_eager, seed=args.seed, tensor_parallel_size=tp)
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        _say(f"error: the engine could not start: {type(exc).__name__}: {exc}")
        return None
    config = llm.config
    devices = config.device if tp == 1 else f"{tp} ranks from {config.device}"
    _say(f"engine ready in {time.perf_counter() - start:.1f} s: {devices}, {config.dtype}, "
         f"max_model_len {config.max_model_len}, KV cache {config.num_kv_blocks * config.block_size} tokens"
         f"{' per rank' if tp > 1 else ''}, max_num_seqs {config.max_num_seqs}")
    return llm


def _serve(args: argparse.Namespace, llm, sock: socket.socket, admin_token: str | None, api_key: str | None) -> int:
    from pathlib import Path

    from torpor.server import ServerConfig

    name = args.served_model_name or Path(llm.config.model).name
    try:
        config = ServerConfig(name, admin_token=admin_token, api_key=api_key, max_body_bytes=args.max_body_bytes,
                              max_tokens_cap=args.max_tokens_cap, asleep_timeout=args.asleep_timeout,
                              allowed_weights_dir=args.allowed_weights_dir)
    except ValueError as exc:
        _say(f"error: {exc}")
        llm.close()
        return 2
    try:
        return _run_server(args, llm, config, sock)
    finally:
        llm.close()  # tensor parallel: the workers stop and every rank leaves the process group


def _run_server(args: argparse.Namespace, llm, config, sock: socket.socket) -> int:
    import uvicorn

    from torpor.server import build_app

    name, admin_token, api_key = config.model_name, config.admin_token, config.api_key
    server = uvicorn.Server(uvicorn.Config(build_app(llm.engine, config), log_level=args.log_level,
                                           access_log=args.access_log, timeout_graceful_shutdown=10))
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    _say(f"serving {name!r} on http://{url_host}:{port} (control plane: "
         f"{'on' if admin_token else 'off, no --admin-token'}; API key: {'required' if api_key else 'none'})")
    # SIGTERM then ends the server like Ctrl-C: a graceful shutdown, then exit code 0.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    except SystemExit as exc:  # uvicorn's own exit: the app failed to start
        _say(f"error: the server stopped (uvicorn exit code {exc.code})")
        return EXIT_ENGINE
    _say("stopped")
    return 0 if server.started else EXIT_ENGINE


def _say(message: str) -> None:
    print(f"torpor serve: {message}", file=sys.stderr, flush=True)


def port_number(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {port}")
    return port


def positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {number}")
    return number


def seconds(value: str) -> float:
    seconds = float(value)
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {value}")
    return seconds
