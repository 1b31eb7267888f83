"""`ServerState`: what the routes of one app share (`request.app.state.server`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torpor.server.async_engine import AsyncEngine
from torpor.server.config import ServerConfig
from torpor.server.metrics import Metrics


@dataclass
class ServerState:
    """The engine, the configuration and the metrics of one server."""

    engine: AsyncEngine
    config: ServerConfig
    allowed_weights_dir: Path  # resolved: /reload_weights reads only inside it
    metrics: Metrics = field(default_factory=Metrics)
    started: int = field(default_factory=lambda: int(time.time()))
    weights: Any = None  # weight_pipeline.WeightPipeline, made on the first push
    transfer_update: str | None = None  # the four-phase update begun over HTTP (vllm_api.py)
    transfer_timer: Any = None  # its idle timeout (an asyncio.TimerHandle)
