"""Engine configuration: one frozen dataclass, validated on construction.

Torch-free on purpose: the scheduler and block manager read it without importing torch.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from dataclasses import dataclass

DTYPE_NAMES = ("bfloat16", "float16", "float32")  # every dtype the engine runs in (one list: models/config.py
# maps them to torch dtypes, the kernels and loaders take exactly these)
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)  # "auto": the checkpoint's
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other names
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
LOAD_FORMATS = ("auto", "dummy")
# Without an explicit budget the prefill batch holds at least this many tokens (and always a
# whole max_model_len prompt, since prefill is not chunked).
_DEFAULT_BATCHED_TOKENS = 16384
WEIGHT_TRANSFER_BACKENDS = ("nccl", "ipc")  # vLLM's backends that torpor has (sparse_nccl, ... are refused)
_CLASS_PATH_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+$")


@dataclass(frozen=True)
class WeightTransferConfig:
    """vLLM's `WeightTransferConfig`: the backend of the four-phase weight transfer (`init_weight_transfer_engine`,
    `start_weight_update`, `update_weights`, `finish_weight_update`). "nccl": a process group to the trainer (NCCL on
    CUDA, gloo on CPU); "ipc": the trainer's tensors by reference (CUDA IPC handles, shared memory on CPU)."""

    backend: str = "nccl"

    def __post_init__(self) -> None:
        if self.backend not in WEIGHT_TRANSFER_BACKENDS:
            raise ValueError(f"weight_transfer_config: backend must be one of {WEIGHT_TRANSFER_BACKENDS}, got "
                             f"{self.backend!r}")

    @classmethod
    def of(cls, value: WeightTransferConfig | dict | None) -> WeightTransferConfig | None:
        """vLLM's forms: a WeightTransferConfig, a dict of its fields (`{"backend": "ipc"}`), or None (off). An
        unknown field is refused by name."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"weight_transfer_config must be a dict such as {{'backend': 'ipc'}} or a "
                             f"WeightTransferConfig, got {type(value).__name__}")
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"weight_transfer_config: unknown field(s) {unknown}; torpor's has only 'backend' "
                             "(whether an update is packed is read from each update_info)")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to size its state.

    `num_kv_blocks` is unknown until the model runner has profiled memory; it fills it in with
    `dataclasses.replace(config, num_kv_blocks=n)` (see `with_num_kv_blocks`), which re-validates.
    """

    model: str                                   # Hugging Face checkpoint folder
    tokenizer: str | None = None                 # tokenizer folder; None: the model's
    generation_config: str = "auto"              # request defaults: "auto" (the model's), "vllm" (none), a folder
    dtype: str = "auto"                          # "auto" = the checkpoint's torch_dtype
    device: str = "auto"                         # "auto" | "cpu" | "cuda" | "cuda:N"
    max_model_len: int = 4096                    # prompt + output tokens of one sequence
    max_num_seqs: int = 256                      # sequences running at once
    max_num_batched_tokens: int | None = None    # None: max(16384, max_model_len)
    block_size: int = 16                         # tokens per KV-cache block
    gpu_memory_utilization: float = 0.9          # fraction of device memory the engine may use
    enforce_eager: bool = False                  # True: never capture CUDA graphs
    seed: int = 0                                # seeds unseeded requests (see Scheduler.add)
    tensor_parallel_size: int = 1               # ranks (processes, one device each) the model is split over
    tp_timeout_s: float = 600.0                  # tensor parallel: a worker silent this long counts as hung
    num_kv_blocks: int | None = None             # filled by memory profiling
    # Sleep mode: reserve (pin) the host copies a level-1 sleep needs in the background after start-up, so
    # the first sleep runs as fast as the later ones. Holds host memory of the weights' size; off where the
    # host is short of it (the first sleep then pins them itself).
    reserve_host_copies: bool = True
    # Automatic prefix caching: full KV blocks are shared between requests with the same prefix (and the
    # n samples of one request share their prompt's blocks). Off: every sequence computes its own prompt.
    enable_prefix_caching: bool = True
    max_n: int = 256                             # the most samples (`SamplingParams.n`) one request may ask for
    # The model's GEMMs on CUDA: "cublaslt" (torpor/engine/cublaslt.py says why) or "torch" (F.linear through
    # PyTorch's cuBLAS handle: +66 MiB of device memory per thread that stays while the engine sleeps).
    gemm: str = "cublaslt"
    # Tensor parallelism's collectives on CUDA: "nccl" (NCCL's communicator, ~1 GiB per GPU that stays while
    # asleep) or "torpor" (a symmetric buffer that sleeps with the engine: tensor_exchange.py).
    tp_comm: str = "nccl"
    # Reader threads of the staged weight loader; 0: one per core this process may use (at most one per
    # staging buffer), half of those for the load beside the start-up.
    load_threads: int = 0
    # Read back the activation peak that sizes the KV cache from an earlier start-up with the same model,
    # options, code and GPU (profile_cache.py) instead of measuring it again.
    kv_profile_cache: bool = True
    # "auto": the weights from the model folder's safetensors; "dummy": drawn in place from a generator seeded by
    # `seed` (weights/dummy.py: benchmarks of geometries whose checkpoint is not on disk; the folder needs
    # config.json and the tokenizer). reload_weights() of the model folder draws the same values again.
    load_format: str = "auto"
    # vLLM's native weight transfer (the four phases; weights/transfer.py): its backend, None when off.
    weight_transfer_config: WeightTransferConfig | None = None
    # vLLM's worker extension: "pkg.module.Class", whose methods are mixed into every rank's Worker
    # (executor/base.py `with_extension`) and reached by collective_rpc; None: none.
    worker_extension_cls: str | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is None:
            # Frozen dataclass: resolving the derived default is the one permitted write.
            object.__setattr__(self, "max_num_batched_tokens",
                               max(_DEFAULT_BATCHED_TOKENS, self.max_model_len))
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty checkpoint path, got {self.model!r}")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise ValueError(f"tokenizer must be None or a non-empty folder path, got {self.tokenizer!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "tensor_parallel_size", "max_n"):
            _check_positive_int(name, getattr(self, name))
        _check_int("seed", self.seed)
        if not isinstance(self.reserve_host_copies, bool):
            raise ValueError(f"reserve_host_copies must be True or False, got {self.reserve_host_copies!r}")
        for name in ("enable_prefix_caching", "kv_profile_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name, choices in (("gemm", ("cublaslt", "torch")), ("tp_comm", ("nccl", "torpor"))):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        _check_int("load_threads", self.load_threads)
        if self.load_threads < 0:
            raise ValueError(f"load_threads must be >= 0 (0: one per core), got {self.load_threads}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.weight_transfer_config is not None and not isinstance(self.weight_transfer_config,
                                                                          WeightTransferConfig):
            raise ValueError("weight_transfer_config must be a WeightTransferConfig (WeightTransferConfig.of "
                             f"makes one of a dict), got {self.weight_transfer_config!r}")
        ext = self.worker_extension_cls
        if ext is not None and (not isinstance(ext, str) or not _CLASS_PATH_RE.match(ext)):
            raise ValueError(f"worker_extension_cls must be a class's dotted path 'pkg.module.Class', got {ext!r}")
        if self.block_size & (self.block_size - 1):
            # The Triton decode kernel tiles one block with tl.arange, which needs a power of two.
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}): prefill is not chunked, so one batch must hold a whole sequence")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs})")
        if isinstance(self.tp_timeout_s, bool) or not isinstance(self.tp_timeout_s, int | float) \
                or not self.tp_timeout_s > 0:
            raise ValueError(f"tp_timeout_s must be a number > 0, got {self.tp_timeout_s!r}")
        gmu = self.gpu_memory_utilization
        if isinstance(gmu, bool) or not isinstance(gmu, int | float) or not 0.0 < gmu <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gmu!r}")
        if self.num_kv_blocks is not None:
            _check_positive_int("num_kv_blocks", self.num_kv_blocks)
            if self.num_kv_blocks * self.block_size < self.max_model_len:
                raise ValueError(
                    f"the KV cache holds {self.num_kv_blocks} blocks x {self.block_size} tokens = "
                    f"{self.num_kv_blocks * self.block_size} tokens, fewer than max_model_len "
                    f"({self.max_model_len}); lower max_model_len or raise gpu_memory_utilization")

    def with_num_kv_blocks(self, num_kv_blocks: int) -> EngineConfig:
        """A copy with the profiled KV-cache size (validated like every other field)."""
        return dataclasses.replace(self, num_kv_blocks=num_kv_blocks)

    @property
    def max_num_blocks_per_seq(self) -> int:
        """Width of a block table: blocks one sequence of max_model_len tokens needs."""
        return -(-self.max_model_len // self.block_size)

    @property
    def cuda_graph_batch_sizes(self) -> tuple[int, ...]:
        """Decode batch sizes a CUDA graph is captured for: 1, 2, 4, 8, then every multiple of 8,
        and max_num_seqs itself, so every batch pads to at most 7 extra rows."""
        sizes = [s for s in (1, 2, 4) if s < self.max_num_seqs]
        sizes += range(8, self.max_num_seqs, 8)
        return (*sizes, self.max_num_seqs)

    def padded_batch_size(self, num_seqs: int) -> int:
        """The smallest captured batch size that fits `num_seqs` decode sequences."""
        sizes = self.cuda_graph_batch_sizes
        i = bisect.bisect_left(sizes, num_seqs)
        if num_seqs < 1 or i == len(sizes):
            raise ValueError(f"num_seqs must be in [1, {self.max_num_seqs}], got {num_seqs}")
        return sizes[i]


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")


def _check_positive_int(name: str, value: object) -> None:
    _check_int(name, value)
    if value < 1:  # type: ignore[operator]
        raise ValueError(f"{name} must be >= 1, got {value}")
