"""Models named as users name them: a checkpoint folder, or a Hugging Face Hub id such as `Qwen/Qwen3-0.6B`.

One place resolves names (`LLM(...)`, `torpor serve`, `--tokenizer` all call `resolve_model`). A local
folder wins over a Hub id. A Hub id resolves through `huggingface_hub.snapshot_download`, which honours
the local cache and its environment (`HF_HOME`, `HF_HUB_CACHE`, `HF_HUB_OFFLINE`, `HF_TOKEN`): a cached
snapshot is used as it is; online, missing files are downloaded (with progress bars) into the cache.
"""

from __future__ import annotations

import re
from pathlib import Path

# What the engine reads of a Hub repository: configs, tokenizer files, templates, safetensors weights
# (not the .bin / .pth / .gguf copies many repositories also carry).
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model")
# owner/name (or a bare name), as the Hub spells repository ids
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")


def resolve_model(name: str | Path, what: str = "model") -> str:
    """The local folder of `name`: the folder itself, or the Hub snapshot of the repository `name`
    (downloaded when missing and the Hub is reachable). FileNotFoundError says where it looked."""
    text = str(name)
    if not text:
        raise ValueError(f"the {what} name is empty")
    try:
        path = Path(text).expanduser()
        is_dir, exists = path.is_dir(), path.exists()
    except (OSError, RuntimeError):  # a name too long for the file system, an unknown ~user
        is_dir = exists = False
    if is_dir:
        return str(path)
    if exists:
        raise NotADirectoryError(f"{what} {text!r} is a file; give the checkpoint folder")
    if not looks_like_hub_id(text):
        raise FileNotFoundError(f"{what} {text!r}: no such folder (and not a Hugging Face Hub id like 'Org/Name')")
    return _snapshot(text, what)


def looks_like_hub_id(name: str) -> bool:
    """True for `owner/name` or `name` spelled as the Hub allows (no path syntax such as ./, ~ or //)."""
    return bool(_HUB_ID.match(name)) and ".." not in name and not name.endswith(".")


def _snapshot(repo_id: str, what: str) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    cache = constants.HF_HUB_CACHE
    try:
        return snapshot_download(repo_id, allow_patterns=list(ALLOW_PATTERNS))
    except LocalEntryNotFoundError as exc:
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        raise FileNotFoundError(
            f"{what} {repo_id!r}: no local folder of that name, and no cached snapshot of the Hugging Face Hub "
            f"repository in {cache}{offline}; it could not be downloaded: {_first_line(exc)}") from None
    except GatedRepoError:
        raise FileNotFoundError(f"{what} {repo_id!r}: the Hugging Face Hub repository is gated; accept its terms "
                                f"on the Hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{what} {repo_id!r}: no local folder of that name, and the Hugging Face Hub has "
                                f"no such repository (or it is private: set HF_TOKEN)") from None


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
