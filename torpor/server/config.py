"""`ServerConfig`: the server's own options (the engine's are `LLM` arguments)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torpor.server.tool_calls import TOOL_PARSERS

MiB = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    """model_name: the id `/v1/models` lists and requests must name (or omit).
    admin_token: bearer token of the control plane (sleep, wake, reload, memory); None turns it off.
    control_plane_auth: "token" (the default): the control plane needs `admin_token`; "none": it is open to anyone
        who reaches the server (drop-in use by clients that send no token: vLLM's and SGLang's own), for a server
        on a loopback address only (`torpor serve` refuses it elsewhere), logged as a WARNING at start.
    api_key: bearer token the inference endpoints require; None leaves them open.
    max_body_bytes: larger request bodies get 413.
    max_tokens_cap: larger `max_tokens` get 400 (None: the engine's max_model_len).
    asleep_timeout: seconds a request waits for a sleeping engine before 503 (None: waits until the
        wake); a request can set its own with the `X-Asleep-Timeout` header.
    allowed_weights_dir: `/reload_weights {"path"}` reads only inside this folder (symlinks resolved);
        None: the served model's parent folder.
    push_idle_timeout_s: a weight push (torpor's push headers) none of whose requests came for this long is given
        up as failed: its trainer died or stalled, and nothing runs while a push is in progress.
    max_prompts_per_request: larger batches of prompts (/v1/completions, /generate) get 400.
    tool_call_parser: how tool calls are read from the model's output (`server/tool_calls.py`: "hermes");
        None: chat requests get no `tool_calls` (tool_choice "auto" is refused, as vLLM does).
    enable_auto_tool_choice: allow tool_choice "auto" (vLLM's --enable-auto-tool-choice; needs
        tool_call_parser)."""

    model_name: str
    admin_token: str | None = None
    api_key: str | None = None
    max_body_bytes: int = MiB
    max_tokens_cap: int | None = None
    asleep_timeout: float | None = None
    allowed_weights_dir: str | None = None
    push_idle_timeout_s: float = 10.0
    max_prompts_per_request: int = 1024
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    control_plane_auth: str = "token"

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name must be a non-empty string, got {self.model_name!r}")
        for name in ("admin_token", "api_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty string or None")
        for name in ("max_body_bytes", "max_tokens_cap", "max_prompts_per_request"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        timeout = self.asleep_timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                    or not math.isfinite(timeout) or timeout < 0):
            raise ValueError(f"asleep_timeout must be a finite number of seconds >= 0, got {timeout!r}")
        idle = self.push_idle_timeout_s
        if isinstance(idle, bool) or not isinstance(idle, int | float) or not 0 < idle <= 3600:
            raise ValueError(f"push_idle_timeout_s must be a number of seconds in (0, 3600], got {idle!r}")
        folder = self.allowed_weights_dir
        if folder is not None and (not isinstance(folder, str) or not folder or "\x00" in folder):
            raise ValueError(f"allowed_weights_dir must be a folder path or None, got {folder!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if not isinstance(self.enable_auto_tool_choice, bool):
            raise ValueError(f"enable_auto_tool_choice must be a bool, got {self.enable_auto_tool_choice!r}")
        if self.control_plane_auth not in ("token", "none"):
            raise ValueError(f"control_plane_auth must be 'token' or 'none', got {self.control_plane_auth!r}")
        if self.control_plane_auth == "none" and self.admin_token is not None:
            raise ValueError("control_plane_auth 'none' opens the control plane, and an admin token was given too "
                             "(--admin-token or TORPOR_ADMIN_TOKEN): choose one")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice requires tool_call_parser (vLLM: --enable-auto-tool-choice "
                             "requires --tool-call-parser)")
