"""Default sampling parameters from a checkpoint's `generation_config.json`, as vLLM applies them.

`EngineConfig.generation_config` (`--generation-config`): "auto" reads the model folder's file, "vllm"
ignores it, any other value is a folder holding one. The defaults fill what a request leaves out:
`LLM.generate` without sampling params, and server requests that omit the field.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from torpor.engine.models.config import read_json_object
from torpor.engine.sampling_params import SamplingParams

logger = logging.getLogger("torpor.engine")

# generation_config.json key -> SamplingParams field (vLLM's list).
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(generation_config: str, model: str) -> dict[str, Any]:
    """SamplingParams field -> default value. ValueError for a missing folder or an unreadable file."""
    if generation_config == "vllm":
        return {}
    folder = model if generation_config == "auto" else generation_config
    return dict(_read(str(Path(folder).expanduser()), required=generation_config != "auto"))


@functools.lru_cache(maxsize=8)
def _read(folder: str, required: bool) -> tuple[tuple[str, Any], ...]:

    file = Path(folder) / "generation_config.json"
    if not file.is_file():
        if required:
            raise ValueError(f"generation config: no generation_config.json in {folder}")
        return ()
    try:
        config = read_json_object(file)
    except (OSError, ValueError) as exc:
        raise ValueError(f"generation config {file}: {exc}") from None
    known = SamplingParams.__dataclass_fields__
    defaults = {}
    for key, field in FIELDS.items():
        if config.get(key) is None:
            continue
        if field in known:
            defaults[field] = config[key]
        else:
            logger.warning("generation_config.json sets %s=%r, which this engine's sampler does not have: not "
                           "applied", key, config[key])
    if type(defaults.get("top_k")) is int and defaults["top_k"] == 0:
        defaults["top_k"] = -1  # Hugging Face's (and vLLM's) 0: no top-k filtering
    try:  # checked here, once: not as an error in every request that leaves the field out
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"generation config {file}: {exc}") from None
    return tuple(defaults.items())
