"""The activation peak that sizes the KV cache, kept on disk between start-ups.

On CUDA the KV cache gets what is left once the weights and the peak of a worst-case step are counted; that
peak is measured by running the step (kv_cache.py), ~1 s of a qwen3-8b start-up on an H200 (docs/weights.md),
the largest phase after the imports. The peak depends only on what is in the key below: the model's
shapes and dtype, the engine options that shape the step, torpor's engine code, torch and the GPU. A restart
with the same key reads it back instead of running the step; anything else (another option, an edited source
file, another torch) makes a new key and measures again. EngineConfig.kv_profile_cache=False turns it off.

What is kept is a `StepMemory`: the step's peak in PyTorch's allocator, and what its first run left on the
device outside the allocator (kernel code CUDA loads on first use, ~tens of MiB): a start-up that reads the
peak back has not loaded that code yet and must count it all the same.

Files: `$TORPOR_CACHE/kv-profile/<key>.json`, written atomically; an unreadable or malformed file is measured
over.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from torpor.engine.config import EngineConfig
from torpor.engine.models.config import ModelConfig
from torpor.env import Env

logger = logging.getLogger("torpor.engine")

# The EngineConfig fields the profiling step depends on (kv_cache._profile_step and its sampler).
_CONFIG_FIELDS = ("dtype", "max_num_batched_tokens", "max_model_len", "max_num_seqs", "tensor_parallel_size")


@functools.cache
def _engine_code_hash() -> str:
    """A hash of torpor's engine sources (an edit there may change the peak)."""
    digest = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_key(config: EngineConfig, model_config: ModelConfig, device: torch.device, rank: int = 0) -> str:
    """What the measured peak depends on, hashed."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = f"{props.name}/{props.total_memory}"
    else:
        gpu = device.type
    material = {
        "config": {name: getattr(config, name) for name in _CONFIG_FIELDS},
        "model": repr(model_config),
        "engine_code": _engine_code_hash(),
        "torch": f"{torch.__version__}/{torch.version.cuda}",
        "gpu": gpu,
        "rank": rank,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _path(key: str) -> Path:
    return Path(Env.read().cache_dir) / "kv-profile" / f"{key}.json"


@dataclass(frozen=True)
class StepMemory:
    peak_bytes: int  # the worst-case step's peak in PyTorch's allocator
    outside_bytes: int  # left on the device outside the allocator by the step's first run (kernel code)


def load(key: str) -> StepMemory | None:
    """The StepMemory stored under `key`, or None (none stored, or not readable)."""
    try:
        stored = json.loads(_path(key).read_text())
        found = StepMemory(stored["peak_bytes"], stored["outside_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    values = (found.peak_bytes, found.outside_bytes)
    return found if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values) else None


def store(key: str, step: StepMemory) -> None:
    """Keep `step` under `key` (atomically; a failure to write is logged and ignored)."""
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(asdict(step), f)
        os.replace(f.name, path)
    except OSError as exc:
        logger.debug("KV-cache sizing: could not keep the profiled step in %s (%s)", path, exc)


def step_memory(key: str, measure: Callable[[], StepMemory], enabled: bool = True) -> tuple[StepMemory, bool]:
    """(the step's memory, whether it came from the cache): read back under `key`, else `measure()`d and kept.
    Not `enabled` (EngineConfig.kv_profile_cache False): always measured, and not kept."""
    if not enabled:
        return measure(), False
    found = load(key)
    if found is not None:
        logger.debug("KV-cache sizing: a step's peak %.3f GiB (+%.0f MiB of kernel code) from an earlier start-up "
                     "(%s)", found.peak_bytes / 2**30, found.outside_bytes / 2**20, _path(key))
        return found, True
    measured = measure()
    store(key, measured)
    return measured, False
