"""Every environment switch torpor reads, typed, in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def _choice(name: str, choices: tuple[str, ...]) -> str:
    raw = os.environ.get(name) or choices[0]
    if raw not in choices:
        raise ValueError(f"environment variable {name} must be one of {', '.join(choices)}, got {raw!r}")
    return raw


@dataclass(frozen=True)
class Env:
    # torpor.memory: a woken segment is mapped in pieces of this many MiB so its refill starts
    # before the whole segment is mapped (0: map each segment whole). 64 MiB measured best on an
    # H200 (docs/memory-gpu-results.md).
    wake_piece_mib: int
    # Where the embedded default model and other generated files are cached.
    cache_dir: str
    # `torpor serve`: bearer token of the control plane (off when unset) and API key of the
    # inference endpoints (open when unset); the --admin-token / --api-key options win.
    admin_token: str | None
    api_key: str | None
    # The model's GEMMs on CUDA: "cublaslt" (default; torpor/engine/cublaslt.py says why) or "torch"
    # (F.linear, PyTorch's cuBLAS handle: +66 MiB of device memory per thread that stays while asleep).
    gemm: str
    # The `torpor` command: show the traceback of an error instead of its one-line message.
    traceback: bool
    # Tensor parallelism's collectives on CUDA: "nccl" (default: NCCL's communicator, ~1 GiB per GPU that stays
    # while asleep) or "torpor" (a symmetric buffer that sleeps with the engine, tensor_exchange.py; opt-in
    # until it has run on GPUs).
    tp_comm: str
    # torpor.memory debug switch: before a sleep keeps a host copy marked clean instead of copying again,
    # hash the device bytes and the copy and raise StaleCopyError if they differ (a write nobody declared).
    verify_clean_copies: bool = False
    # TORPOR_DEBUG=1: the engine's debug log (`torpor.engine`: start-up phases, weight loads) on stderr.
    debug: bool = False
    # TORPOR_KV_PROFILE_CACHE=0: measure the activation peak that sizes the KV cache at every start-up instead of
    # reading back the one an earlier start-up with the same model, options, code and GPU measured
    # (engine/profile_cache.py).
    kv_profile_cache: bool = True
    # TORPOR_DECODE_PREFIXES=0: the GPU decode kernel reads every sequence's whole context itself instead of
    # reading each shared prompt prefix once per group of sequences (attention/triton_decode.py); for A/B runs.
    decode_prefixes: bool = True
    # TORPOR_OVERLAP_LOAD (default 1): the start-up loads the weights on a thread of their own beside the KV sizing
    # and the graph capture (engine/weights/background_load.py); 0 loads them first. On by default since runs 20, 22 of
    # 2026-12-02 (half the cores reading): 0.3 s faster with the page cache warm, 1.2-2.4 s with it cold
    # (docs/weights.md).
    overlap_load: bool = True
    # TORPOR_LOAD_THREADS: the staged loader's reader threads (0: one per core this process may use, at most one per
    # staging buffer; beside the start-up, half of those, leaving cores to the graph capture).
    load_threads: int = 0
    # TORPOR_CAPTURE_WARMUPS (default first): only the largest CUDA-graph batch size gets an eager warm-up step before
    # its capture, the others' first uses happening inside their captures; "every" warms every size up
    # (engine/cuda_graphs.py). The default since 2026-12-02's runs 24-25: the whole GPU suite passed under it, the
    # capture phase 0.2-0.5 s shorter (docs/weights.md).
    capture_warmups: str = "first"

    @classmethod
    def read(cls) -> Env:
        return cls(
            wake_piece_mib=_int("TORPOR_WAKE_PIECE_MIB", 64),
            cache_dir=os.environ.get("TORPOR_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "torpor"),
            admin_token=os.environ.get("TORPOR_ADMIN_TOKEN") or None,
            api_key=os.environ.get("TORPOR_API_KEY") or None,
            gemm=_choice("TORPOR_GEMM", ("cublaslt", "torch")),
            traceback=os.environ.get("TORPOR_TRACEBACK", "") not in ("", "0"),
            tp_comm=_choice("TORPOR_TP_COMM", ("nccl", "torpor")),
            verify_clean_copies=_choice("TORPOR_VERIFY_CLEAN_COPIES", ("0", "1")) == "1",
            debug=os.environ.get("TORPOR_DEBUG", "") not in ("", "0", "false"),
            kv_profile_cache=_choice("TORPOR_KV_PROFILE_CACHE", ("1", "0")) == "1",
            decode_prefixes=_choice("TORPOR_DECODE_PREFIXES", ("1", "0")) == "1",
            overlap_load=_choice("TORPOR_OVERLAP_LOAD", ("1", "0")) == "1",
            load_threads=_int("TORPOR_LOAD_THREADS", 0),
            capture_warmups=_choice("TORPOR_CAPTURE_WARMUPS", ("first", "every")),
        )
