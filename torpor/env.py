"""The environment variables torpor reads: secrets, the cache folder and debugging switches only. Every
setting of an engine or a server is a field of its frozen configuration (EngineConfig, ServerConfig, the
MemoryManager's arguments), never an environment variable."""

from __future__ import annotations

import os
from dataclasses import dataclass


def _flag(name: str) -> bool:
    raw = os.environ.get(name, "")
    if raw not in ("", "0", "1", "false", "true"):
        raise ValueError(f"environment variable {name} must be 0 or 1, got {raw!r}")
    return raw in ("1", "true")


@dataclass(frozen=True)
class Env:
    # TORPOR_CACHE: where the embedded default model, the KV-sizing profiles and other generated files are kept.
    cache_dir: str
    # TORPOR_ADMIN_TOKEN / TORPOR_API_KEY (`torpor serve`): the control plane's bearer token (off when unset) and
    # the inference endpoints' API key (open when unset); the --admin-token / --api-key options win.
    admin_token: str | None
    api_key: str | None
    # TORPOR_TRACEBACK=1: the `torpor` command shows the traceback of an error instead of its one-line message.
    traceback: bool = False
    # TORPOR_DEBUG=1: the engine's debug log (`torpor.engine`: start-up phases, weight loads) on stderr.
    debug: bool = False
    # TORPOR_VERIFY_CLEAN_COPIES=1 (torpor.memory): before a sleep keeps a host copy marked clean instead of
    # copying again, hash the device bytes and the copy and raise StaleCopyError if they differ (a write nobody
    # declared).
    verify_clean_copies: bool = False

    @classmethod
    def read(cls) -> Env:
        return cls(
            cache_dir=os.environ.get("TORPOR_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "torpor"),
            admin_token=os.environ.get("TORPOR_ADMIN_TOKEN") or None,
            api_key=os.environ.get("TORPOR_API_KEY") or None,
            traceback=_flag("TORPOR_TRACEBACK"),
            debug=_flag("TORPOR_DEBUG"),
            verify_clean_copies=_flag("TORPOR_VERIFY_CLEAN_COPIES"),
        )
