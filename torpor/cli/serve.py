"""`torpor serve`: an OpenAI-compatible HTTP server with a sleep/wake control plane.

Inference: POST /v1/completions, POST /v1/chat/completions (both with "stream": true),
GET /v1/models, POST /tokenize, POST /detokenize, GET /health, GET /metrics (Prometheus);
SGLang's POST /generate, GET /health_generate, /get_model_info, /get_server_info.
Control plane (needs 'Authorization: Bearer ADMIN_TOKEN'; off without --admin-token):
POST /sleep?level=0|1|2|3|4&mode=wait|abort, POST /wake_up?tags=weights&tags=kv_cache, GET /is_sleeping,
POST /reload_weights {"path": ...}, GET /memory, POST /collective_rpc {"method": ..., "kwargs": {...}},
POST /release_memory_occupation and /resume_memory_occupation {"tags": [...]}; the weight routes: SGLang's
(/update_weights_from_tensor, ..., /update_weights_from_disk, /get_weights_by_name) and, with
--weight-transfer-config, vLLM's four phases (/init_weight_transfer_engine, /start_weight_update, /update_weights,
/finish_weight_update). --control-plane-auth none opens the control plane (loopback addresses only).
Requests that arrive while the engine sleeps wait for the wake (or get 503 after --asleep-timeout).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import socket
import sys
import time

EXIT_CODES = """exit codes:
  0  stopped cleanly (SIGINT / SIGTERM)
  1  the engine could not start (model, device or memory), or the server failed
  2  bad command-line arguments
  3  cannot listen on HOST:PORT (in use, or not an address of this machine)"""
EXIT_ENGINE, EXIT_USAGE, EXIT_LISTEN = 1, 2, 3
def weight_transfer_json(value: str):
    """--weight-transfer-config's JSON as a WeightTransferConfig (vLLM's form: '{"backend": "nccl"}')."""
    import json

    from torpor.engine.config import WeightTransferConfig

    try:
        return WeightTransferConfig.of(json.loads(value))
    except (json.JSONDecodeError, ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"--weight-transfer-config: {exc}") from None


_FIELD_TYPES = {"int": int, "int | None": int, "float": float, "str": str, "str | None": str,
                "WeightTransferConfig | None": weight_transfer_json}


# EngineConfig field -> (help, other option names). Every field listed here is a flag named after it
# (`--max-num-seqs`), typed and defaulted from the dataclass (bools get `--no-...` too); fields not listed
# are internal (NOT_FLAGS). A test checks that every field is one or the other.
ENGINE_FLAGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tokenizer": ("tokenizer folder or Hugging Face Hub id (default: the model's)", ()),
    "generation_config": ("request defaults: 'auto' applies the checkpoint's generation_config.json (temperature, "
                          "top_p, top_k, min_p, repetition_penalty, max_new_tokens) to requests that omit them, as "
                          "vLLM does; 'vllm' ignores it; or a folder holding a generation_config.json", ()),
    "device": ("auto (CUDA when available), cpu, cuda or cuda:N", ()),
    "dtype": ("weight dtype (default: the checkpoint's); half = float16, float = float32", ()),
    "max_model_len": ("prompt + output tokens of one request (default: min(4096, the model's limit))", ()),
    "max_num_seqs": ("requests running at once", ()),
    "max_num_batched_tokens": ("tokens in one prefill batch (default: max(16384, max-model-len))", ()),
    "block_size": ("tokens per KV-cache block, a power of two", ()),
    "gpu_memory_utilization": ("fraction of device memory the engine may use", ()),
    "enforce_eager": ("never capture CUDA graphs", ()),
    "enable_prefix_caching": ("reuse the KV blocks of prompt prefixes already computed", ()),
    "max_n": ("the most samples (n) one request may ask for", ()),
    "reserve_host_copies": ("reserve (pin) the host copies of a level-1 sleep in the background after start-up, "
                            "so the first sleep runs at link speed (holds host memory of the weights' size)", ()),
    "tensor_parallel_size": ("split the model over N processes, one device each. On GPU, rank r uses the device r "
                             "places after --device (cuda:0..cuda:N-1 by default; CUDA_VISIBLE_DEVICES chooses "
                             "them), over NCCL (or --tp-comm torpor: torpor's exchange buffer); on CPU, N "
                             "processes over gloo. Heads, kv heads, intermediate size and vocabulary must divide "
                             "by N. Sleep, wake and weight updates reach every rank",
                             ("--tp",)),
    "tp_timeout_s": ("tensor parallel: seconds after which a silent worker counts as hung", ()),
    "seed": ("seeds requests that give no seed", ()),
    "gemm": ("the model's GEMMs on CUDA: cublaslt (no PyTorch cuBLAS handle, which keeps 66 MiB while asleep) or "
             "torch (F.linear)", ()),
    "tp_comm": ("tensor parallelism's collectives on CUDA: nccl, or torpor (a symmetric buffer that sleeps with the "
                "engine; NCCL's communicator keeps ~1 GiB per GPU while asleep)", ()),
    "load_threads": ("reader threads of the weight loader (0: one per core, half of them beside the start-up)", ()),
    "kv_profile_cache": ("read back the KV-cache sizing's activation peak measured by an earlier start-up with the "
                         "same model, options, code and GPU", ()),
    "load_format": ("auto: the weights from the checkpoint; dummy: drawn on the device from --seed, no weights read "
                    "(benchmarks; the folder needs config.json and the tokenizer: torpor make-model --config-only)",
                    ()),
    "weight_transfer_config": ("vLLM's native weight transfer (POST /init_weight_transfer_engine, "
                               "/start_weight_update, /update_weights, /finish_weight_update): its backend as JSON, "
                               "'{\"backend\": \"nccl\"}' (a process group to the trainer; gloo on CPU) or "
                               "'{\"backend\": \"ipc\"}' (tensors by reference, same device)", ()),
    "worker_extension_cls": ("vLLM's worker extension: pkg.module.Class, whose methods join every rank's Worker "
                             "(POST /collective_rpc reaches them)", ()),
}
NOT_FLAGS = frozenset({"model", "num_kv_blocks"})  # the positional, the profiled
_DEFAULT_OVERRIDES = {"max_model_len": None}  # None: LLM derives it from the model


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API with sleep/wake control",
                       description=__doc__, epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint folder or Hugging Face Hub id, e.g. Qwen/Qwen3-0.6B (resolved through the local "
                        "Hugging Face cache, HF_HOME / HF_HUB_CACHE, and downloaded when missing unless "
                        "HF_HUB_OFFLINE=1; a local folder wins); default: the embedded tiny model")
    p.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                   help="the same as MODEL (vLLM's form)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=port_number, default=8000, help="TCP port (default: 8000; 0 picks a free one)")
    p.add_argument("--served-model-name", default=None,
                   help="model id in /v1/models and requests (default: the Hub id as given, the checkpoint "
                        "folder's name, or 'tiny' for the embedded tiny model)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                   help="Jinja chat template (a file, or the template text) replacing the checkpoint's")
    engine = p.add_argument_group("engine (EngineConfig)")
    add_engine_flags(engine)
    engine.add_argument("--enable-sleep-mode", action="store_true",
                        help="accepted for vLLM compatibility: torpor's sleep mode is always on")
    security = p.add_argument_group("security and limits")
    security.add_argument("--admin-token", default=None,
                          help="bearer token of the control plane; without one it answers 403 (env: "
                               "TORPOR_ADMIN_TOKEN, preferred: options are visible in the process list)")
    security.add_argument("--control-plane-auth", choices=("token", "none"), default="token",
                          help="token (default): the control plane needs the admin token; none: it is open, for "
                               "drop-in use by clients that send no token (vLLM's, SGLang's), refused unless --host "
                               "is a loopback address, and logged as a WARNING at start")
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
    security.add_argument("--max-prompts-per-request", type=positive_int, default=1024,
                          help="prompts one request may batch (/v1/completions, /generate); more get 400 "
                               "(default: 1024)")
    tools = p.add_argument_group("tool calls (vLLM's flags)")
    tools.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="read tool calls from the model's output in this format into the chat answer's "
                            "tool_calls: hermes (Hermes / Qwen <tool_call>{json}</tool_call>)")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='allow tool_choice "auto" (the default when a request has tools); needs '
                            "--tool-call-parser")
    p.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="server (uvicorn) log level (default: info)")
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.set_defaults(func=run)


def add_engine_flags(group) -> None:
    """One flag per ENGINE_FLAGS field of EngineConfig (the fields this torpor has), typed from the field."""
    from torpor.engine.config import DTYPE_ALIASES, DTYPE_CHOICES, LOAD_FORMATS, EngineConfig

    for field in dataclasses.fields(EngineConfig):
        if field.name not in ENGINE_FLAGS:
            continue
        help_text, aliases = ENGINE_FLAGS[field.name]
        names = (f"--{field.name.replace('_', '-')}", *aliases)
        default = _DEFAULT_OVERRIDES.get(field.name, field.default)
        if field.type == "bool":
            group.add_argument(*names, dest=field.name, action=argparse.BooleanOptionalAction, default=default,
                               help=f"{help_text} (default: {'on' if default else 'off'})")
            continue
        options: dict = {"type": _FIELD_TYPES[field.type], "metavar": field.name.upper()}
        if field.name == "dtype":
            options = {"choices": (*DTYPE_CHOICES, *DTYPE_ALIASES)}
        elif field.name == "weight_transfer_config":
            options["metavar"] = "JSON"
        elif field.name == "load_format":
            options = {"choices": LOAD_FORMATS}
        shown = "" if default is None or "default:" in help_text else f" (default: {default})"
        group.add_argument(*names, dest=field.name, default=default, help=help_text + shown, **options)


def engine_options(args: argparse.Namespace) -> dict:
    """The EngineConfig fields the command line set, as `LLM` keyword arguments."""
    return {name: getattr(args, name) for name in ENGINE_FLAGS if hasattr(args, name)}


def run(args: argparse.Namespace) -> int:
    from torpor.env import Env

    env = Env.read()
    problem = _check_args(args)
    if problem:
        _say(f"error: {problem}")
        return EXIT_USAGE
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        _say(f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
        return EXIT_LISTEN
    if args.control_plane_auth == "none" and not is_loopback(sock.getsockname()[0]):
        sock.close()
        _say(f"error: --control-plane-auth none opens the control plane to whoever reaches {args.host}: it is "
             "refused unless the server listens on a loopback address (--host 127.0.0.1 or ::1); elsewhere use "
             "--admin-token")
        return EXIT_USAGE
    llm = _load_engine(args)
    if llm is None:
        sock.close()
        return EXIT_ENGINE
    return _serve(args, llm, sock, admin_token=args.admin_token or env.admin_token,
                  api_key=args.api_key or env.api_key)


def _check_args(args: argparse.Namespace) -> str | None:
    """Resolve --model and --chat-template in `args`; the first problem with the options, or None."""
    from torpor.engine.chat_template import load_chat_template
    from torpor.engine.config import EngineConfig
    from torpor.server.tool_calls import TOOL_PARSERS

    if args.model_option is not None and args.model is not None and args.model_option != args.model:
        return f"two different models: {args.model!r} and --model {args.model_option!r}"
    args.model = args.model_option or args.model
    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_PARSERS:
        return f"--tool-call-parser must be one of {sorted(TOOL_PARSERS)}, got {args.tool_call_parser!r}"
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        return "--enable-auto-tool-choice requires --tool-call-parser"
    for option in ("admin_token", "api_key"):  # `--admin-token "$TOKEN"` with TOKEN unset: not "no token"
        if getattr(args, option) is not None and not getattr(args, option).strip():
            return (f"--{option.replace('_', '-')} is empty (an unset shell variable?): give a value, or leave "
                    "the option out")
    try:
        if args.chat_template is not None:
            args.chat_template = load_chat_template(args.chat_template)
        # Check the values now (exit 2, nothing loaded); the model's own limits are checked when it loads.
        options = {"max_model_len": 1, **{k: v for k, v in engine_options(args).items() if v is not None}}
        EngineConfig(model=args.model or "the embedded tiny model", **{**options, "dtype": "auto"})
    except ValueError as exc:
        return str(exc)
    return None


def is_loopback(address: str) -> bool:
    """Whether a bound address is a loopback one (127.0.0.0/8, ::1)."""
    import ipaddress

    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


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
    from torpor.cli.make_model import preset_hint
    from torpor.engine import LLM, SamplingParams

    tp = args.tensor_parallel_size
    ranks = f", tensor parallel over {tp} ranks" if tp > 1 else ""
    _say(f"loading {args.model or 'the embedded tiny model'} (device {args.device}, dtype {args.dtype}{ranks}) ...")
    start = time.perf_counter()
    try:
        llm = LLM(args.model, **engine_options(args))
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        _say(f"error: the engine could not start: {type(exc).__name__}: {exc}{preset_hint(args.model, 'serve')}")
        return None
    if args.chat_template is not None:
        llm.get_tokenizer().chat_template = args.chat_template
    config = llm.config
    devices = config.device if tp == 1 else f"{tp} ranks from {config.device}"
    dtype = config.dtype
    if dtype == "auto":  # the checkpoint's: say which
        from torpor.engine.models.config import ModelConfig

        dtype = str(ModelConfig.from_pretrained(config.model).torch_dtype).removeprefix("torch.")
    _say(f"engine ready in {time.perf_counter() - start:.1f} s: {devices}, {dtype}, "
         f"max_model_len {config.max_model_len}, KV cache {config.num_kv_blocks * config.block_size} tokens"
         f"{' per rank' if tp > 1 else ''}, max_num_seqs {config.max_num_seqs}")
    defaults = llm.get_default_sampling_params()
    if defaults != SamplingParams():
        changed = {k: v for k, v in dataclasses.asdict(defaults).items() if getattr(SamplingParams(), k) != v}
        _say(f"request defaults from generation_config.json (--generation-config {config.generation_config}): "
             + ", ".join(f"{k}={v}" for k, v in changed.items()))
    return llm


def _serve(args: argparse.Namespace, llm, sock: socket.socket, admin_token: str | None, api_key: str | None) -> int:
    from torpor.server import ServerConfig

    name = args.served_model_name or _default_name(args.model, llm.config.model)
    try:
        config = ServerConfig(name, admin_token=admin_token, api_key=api_key, max_body_bytes=args.max_body_bytes,
                              max_tokens_cap=args.max_tokens_cap, asleep_timeout=args.asleep_timeout,
                              allowed_weights_dir=args.allowed_weights_dir,
                              max_prompts_per_request=args.max_prompts_per_request,
                              tool_call_parser=args.tool_call_parser,
                              enable_auto_tool_choice=args.enable_auto_tool_choice,
                              control_plane_auth=args.control_plane_auth)
    except ValueError as exc:
        _say(f"error: {exc}")
        llm.close()
        return 2
    try:
        return _run_server(args, llm, config, sock)
    finally:
        llm.close()  # tensor parallel: the workers stop and every rank leaves the process group


def _default_name(given: str | None, folder: str) -> str:
    """A Hub id as the user typed it (what vLLM serves it as); a folder by its name; the embedded tiny model
    by its preset's name, "tiny" (its cache folder's name carries the generator's version)."""
    from pathlib import Path

    from torpor.engine.model_path import looks_like_hub_id
    from torpor.synthetic.generator import DEFAULT_PRESET

    if given is None:
        return DEFAULT_PRESET
    if not Path(given).expanduser().exists() and looks_like_hub_id(given):
        return given
    return Path(folder).name


def _run_server(args: argparse.Namespace, llm, config, sock: socket.socket) -> int:
    import uvicorn

    from torpor.server import build_app

    name, admin_token, api_key = config.model_name, config.admin_token, config.api_key
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    control = "OPEN, no token (--control-plane-auth none)" if config.control_plane_auth == "none" else \
        "on" if admin_token else "off, no --admin-token"
    announcement = (f"serving {name!r} on http://{url_host}:{port} (control plane: {control}; API key: "
                    f"{'required' if api_key else 'none'})")

    class AnnouncingServer(uvicorn.Server):
        """Announces the address once uvicorn's start-up is complete (the app's lifespan ran, the socket
        listens): a launch script that waits for the line can connect at once."""

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                _say(announcement)

    server = AnnouncingServer(uvicorn.Config(build_app(llm.engine, config), log_level=args.log_level,
                                             access_log=args.access_log, timeout_graceful_shutdown=10))
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
