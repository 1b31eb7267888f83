"""Write a synthetic checkpoint in the exact Hugging Face layout, deterministic from a seed.

Every tensor is drawn from its own CPU `torch.Generator`, seeded from (seed, tensor name): the bytes do
not depend on the order of generation, the thread count or the machine, and tensors are generated in
parallel threads (a CPU generator is serial) and streamed to disk, shard by shard."""

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from torpor.engine.models.config import DTYPES, ModelConfig
from torpor.engine.weights.manifest import TensorSpec, weight_specs
from torpor.env import Env
from torpor.synthetic.presets import Preset, get_preset
from torpor.synthetic.safetensors_writer import tensor_nbytes, write_header, write_tensor
from torpor.synthetic.tokenizer_builder import build_tokenizer, special_token_ids, tokenizer_config

GENERATOR_VERSION = 2  # bump when the generated files change: names the cached checkpoints
DEFAULT_PRESET = "tiny"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's "5GB"
_CHUNK = 1 << 22  # elements drawn per call: bounds the float32 temporaries



def make_model(
    preset: str,
    out_dir: str | Path,
    seed: int = 0,
    dtype: str | torch.dtype | None = None,
    progress: bool = True,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    config_only: bool = False,
) -> Path:
    """Write preset `preset` into `out_dir` (created if needed): config.json, generation_config.json,
    model.safetensors (or shards + model.safetensors.index.json), tokenizer.json, tokenizer_config.json.
    `dtype` defaults to the preset's (bfloat16). Same arguments, byte-identical files. `config_only`: everything
    but the weights, for an engine with `load_format="dummy"` (a 30B geometry on a machine without the disk for
    its 61 GB)."""
    spec = get_preset(preset)
    dtype_name = _dtype_name(dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("model*.safetensors*"):  # an earlier, differently sharded checkpoint
        stale.unlink()
    tokenizer = build_tokenizer(spec)
    config = config_json(spec, dtype_name)
    model_config = ModelConfig.from_dict(config)  # validates the preset
    _write_json(out / "config.json", config)
    bos, eos = config["bos_token_id"], config["eos_token_id"]
    _write_json(out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n")
    _write_json(out / "tokenizer_config.json", tokenizer_config(spec))
    if not config_only:
        _write_weights(out, weight_specs(model_config), DTYPES[dtype_name], seed, max_shard_bytes, progress)
    return out


def preset_bytes(preset: str, dtype: str | torch.dtype | None = None) -> int:
    """The bytes of `preset`'s weights in `dtype` (default bfloat16), without writing anything."""
    config = ModelConfig.from_dict(config_json(get_preset(preset), _dtype_name(dtype)))
    return sum(tensor_nbytes(shape, DTYPES[_dtype_name(dtype)]) for _, shape in weight_specs(config))


def default_model_path() -> Path:
    """The embedded default model (`tiny`, seed 0), generated once into the cache directory
    ($TORPOR_CACHE, else ~/.cache/torpor)."""
    path = Path(Env.read().cache_dir) / "models" / f"{DEFAULT_PRESET}-v{GENERATOR_VERSION}"
    return _generate_once(DEFAULT_PRESET, path, dtype=None, progress=False)


def cached_model_path(preset: str, progress: bool = True, models_dir: str | Path | None = None) -> Path:
    """The bf16 checkpoint of `preset` (seed 0), generated once into `models_dir` (default: the cache
    directory's models/; `torpor demo` on a GPU and the benchmarks share it)."""
    get_preset(preset)  # an unknown name fails before anything is written
    root = Path(models_dir) if models_dir is not None else Path(Env.read().cache_dir) / "models"
    path = root / f"{preset}-v{GENERATOR_VERSION}-seed0-bfloat16"
    return _generate_once(preset, path, dtype="bfloat16", progress=progress)


def _generate_once(preset: str, path: Path, dtype: str | None, progress: bool) -> Path:
    """`path`, generated unless it holds a checkpoint. Safe against concurrent callers: each generates into
    a private temporary directory and renames it into place (config.json appears with the complete
    checkpoint only); the first rename wins."""
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        make_model(preset, tmp, dtype=dtype, progress=progress)
        try:
            os.rename(tmp, path)
        except OSError:  # another process renamed its copy first
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def generate_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Norm weights ~ 1 + N(0, 0.05); biases ~ N(0, 0.02); matrices ~ N(0, 1 / in_features), which keeps
    activations and logits of order one in any geometry (finite and non-degenerate in bf16)."""
    if name.endswith("norm.weight"):
        mean, std = 1.0, 0.05
    elif name.endswith(".bias"):
        mean, std = 0.0, 0.02
    else:
        mean, std = 0.0, shape[1] ** -0.5
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    out = torch.empty(math.prod(shape), dtype=dtype)
    for start in range(0, out.numel(), _CHUNK):
        chunk = out[start : start + _CHUNK]
        chunk.copy_(torch.empty(chunk.numel(), dtype=torch.float32).normal_(mean, std, generator=generator))
    return out.view(shape)


def _write_weights(
    out: Path, specs: list[TensorSpec], dtype: torch.dtype, seed: int, max_shard_bytes: int, progress: bool
) -> None:
    shards = plan_shards(specs, dtype, max_shard_bytes)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]  # fmt: skip
    total = sum(tensor_nbytes(shape, dtype) for _, shape in specs)
    workers = max(1, min(16, os.cpu_count() or 1))
    with _ProgressBar(progress, total, out.name) as advance, ThreadPoolExecutor(workers) as pool:
        for file_name, shard in zip(names, shards, strict=True):
            with open(out / file_name, "wb") as f:
                write_header(f, shard, dtype)
                pending: deque = deque()
                for name, shape in shard:  # generate ahead in threads, write in order
                    pending.append(pool.submit(generate_tensor, name, shape, dtype, seed))
                    if len(pending) > 2 * workers:
                        advance(_write_next(f, pending))
                while pending:
                    advance(_write_next(f, pending))
    if len(shards) > 1:
        weight_map = {name: file for file, shard in zip(names, shards, strict=True) for name, _ in shard}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(out / "model.safetensors.index.json", index)


def _write_next(f, pending: deque) -> int:
    tensor = pending.popleft().result()
    write_tensor(f, tensor)
    return tensor.numel() * tensor.element_size()


def plan_shards(specs: list[TensorSpec], dtype: torch.dtype, max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive tensors, a new shard whenever the next tensor would overflow the current one."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = tensor_nbytes(spec[1], dtype)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


class _ProgressBar:
    """Context manager yielding `advance(num_bytes)`; a rich progress bar when enabled."""

    def __init__(self, enabled: bool, total: int, label: str) -> None:
        self.enabled, self.total, self.label = enabled, total, label

    def __enter__(self):
        if not self.enabled:
            return lambda num_bytes: None
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

        self.bar = Progress("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            TimeRemainingColumn())  # fmt: skip
        self.bar.__enter__()
        task = self.bar.add_task(f"writing {self.label}", total=self.total)
        return lambda num_bytes: self.bar.advance(task, num_bytes)

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.bar.__exit__(*exc)


def config_json(spec: Preset, dtype_name: str) -> dict[str, Any]:
    """The preset's config.json, with the token ids of its tokenizer and the dtype filled in."""
    ids = special_token_ids(spec)
    fmt = spec.chat_format
    eos = [ids[token] for token in fmt.config_eos_tokens]
    config = dict(spec.config, bos_token_id=ids[fmt.config_bos_token], eos_token_id=eos[0] if len(eos) == 1 else eos)
    config.update(torch_dtype=dtype_name, transformers_version="4.51.0")
    if max(ids.values()) >= config["vocab_size"]:
        raise ValueError(f"preset {spec.name!r}: special token ids exceed vocab_size {config['vocab_size']}")
    return config


def _dtype_name(dtype: str | torch.dtype | None) -> str:
    if dtype is None:
        return "bfloat16"
    names = {v: k for k, v in DTYPES.items()}
    name = names.get(dtype, dtype) if isinstance(dtype, torch.dtype) else dtype
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    return name


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
