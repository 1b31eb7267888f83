"""`build_app(engine, config)`: the FastAPI application of `torpor serve`."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response

from torpor.engine.llm_engine import LLMEngine
from torpor.server import control, openai_api, rl_api, sglang_api, tokenize_api, vllm_api, weights_api
from torpor.server.async_engine import AsyncEngine
from torpor.server.auth import require_api_key
from torpor.server.config import ServerConfig
from torpor.server.errors import SafeJSONResponse, install_error_handlers
from torpor.server.middleware import BodyLimit, CountRequests
from torpor.server.openapi import openapi_schema
from torpor.server.prompts import Prompts
from torpor.server.state import ServerState

logger = logging.getLogger("torpor.server")

# Who may call what. Public: /health, /is_sleeping. Behind the API key when one is set: /v1/*,
# /metrics (Prometheus scrapers send a bearer token), /openapi.json, /docs, /redoc. Behind the admin
# token: the rest of the control plane (control.py).


def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    """The server of one `LLMEngine` (e.g. `LLM(...).engine`; only the server uses it from then on). The
    engine thread starts with the app (ASGI lifespan) and stops with it."""
    allowed = config.allowed_weights_dir or Path(engine.config.model).parent
    server = ServerState(AsyncEngine(engine), config, Path(os.path.realpath(allowed)))
    prompts = Prompts(engine.tokenizer, engine.config.max_model_len, config.max_prompts_per_request)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if config.control_plane_auth == "none":
            logger.warning("the control plane is OPEN (control_plane_auth 'none'): anyone who reaches this server can "
                           "sleep it, reload and replace its weights, and call its workers' methods; serve it on a "
                           "loopback address only")
        server.engine.start()
        try:
            yield
        finally:
            server.engine.stop()
            prompts.close()
            if server.weights is not None:
                server.weights.close()
            if server.transfer_timer is not None:
                server.transfer_timer.cancel()

    app = FastAPI(title="torpor", summary="OpenAI-compatible server with a sleep/wake control plane",
                  lifespan=lifespan, default_response_class=SafeJSONResponse, openapi_url=None, docs_url=None,
                  redoc_url=None)  # the schema and docs routes below, behind the API key
    app.state.server = server
    app.state.prompts = prompts  # tokenization off the event loop (prompts.py)
    app.openapi = lambda: openapi_schema(app)
    install_error_handlers(app)
    app.include_router(openai_api.router)
    app.include_router(sglang_api.router)
    app.include_router(sglang_api.public_router)
    app.include_router(control.public_router)
    app.include_router(control.router)
    app.include_router(rl_api.router)
    app.include_router(tokenize_api.router)
    app.include_router(weights_api.router)
    app.include_router(vllm_api.router)

    @app.get("/health")
    @app.head("/health", include_in_schema=False)  # load balancers probe with HEAD too
    async def health() -> Response:
        """200 while the engine can serve (asleep or not); 503 with the reason once it cannot (its thread stopped,
        a tensor-parallel worker died or is stopped): what an orchestrator restarts a server on."""
        problem = server.engine.health()
        if problem is not None:
            return SafeJSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)
        return SafeJSONResponse({"status": "ok", "is_sleeping": server.engine.sleeping,
                                 "serving": server.engine.serving})

    @app.get("/metrics", dependencies=[Depends(require_api_key)])
    async def metrics(request: Request) -> Response:
        """Prometheus metrics (text format)."""
        if server.engine.alive:
            server.metrics.update_engine(await server.engine.stats())
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    _add_docs(app)
    routers = (openai_api.router, sglang_api.router, sglang_api.public_router, control.public_router, control.router,
               rl_api.router, tokenize_api.router, weights_api.router, vllm_api.router)
    routes = {"/health", "/metrics", "/openapi.json", "/docs", "/redoc",
              *(r.path for router in routers for r in router.routes)}
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(CountRequests, count=lambda route, status: server.metrics.http_requests.labels(
        route, status).inc(), routes=routes)  # added last: outermost, it counts the 413s too
    return app


def _add_docs(app: FastAPI) -> None:
    """/openapi.json, /docs (Swagger UI) and /redoc, behind the API key when one is set."""
    guarded = [Depends(require_api_key)]

    @app.get("/openapi.json", include_in_schema=False, dependencies=guarded)
    async def openapi() -> SafeJSONResponse:
        return SafeJSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=guarded)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="torpor")

    @app.get("/redoc", include_in_schema=False, dependencies=guarded)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title="torpor")
