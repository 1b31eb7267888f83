"""`build_app(llm, config)`: the FastAPI application of `torpor serve`."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from torpor.server import control, openai_api, weights_api
from torpor.server.async_engine import AsyncEngine
from torpor.server.config import ServerConfig
from torpor.server.errors import install_error_handlers
from torpor.server.metrics import Metrics
from torpor.server.middleware import BodyLimit, CountRequests


@dataclass
class ServerState:
    """What the routes share (`request.app.state.server`)."""

    engine: AsyncEngine
    config: ServerConfig
    metrics: Metrics = field(default_factory=Metrics)
    started: int = field(default_factory=lambda: int(time.time()))


def build_app(llm, config: ServerConfig) -> FastAPI:
    """The server of one `LLM` (it takes the engine over). The engine thread starts with the app
    (ASGI lifespan) and stops with it."""
    server = ServerState(AsyncEngine(llm), config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        try:
            yield
        finally:
            server.engine.stop()

    app = FastAPI(title="torpor", summary="OpenAI-compatible server with a sleep/wake control plane",
                  lifespan=lifespan)
    app.state.server = server
    install_error_handlers(app)
    app.include_router(openai_api.router)
    app.include_router(control.router)
    app.include_router(weights_api.router)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine thread runs (asleep or not), 503 once it has stopped."""
        if not server.engine.alive:
            return JSONResponse({"status": "dead"}, status_code=503)
        return JSONResponse({"status": "ok", "is_sleeping": server.engine.sleeping, "serving": server.engine.serving})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if server.engine.alive:
            server.metrics.update_engine(await server.engine.stats())
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    routes = {"/health", "/metrics", *(r.path for router in (openai_api.router, control.router) for r in router.routes)}
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(CountRequests, count=lambda route, status: server.metrics.http_requests.labels(
        route, status).inc(), routes=routes)  # added last: outermost, it counts the 413s too
    return app
