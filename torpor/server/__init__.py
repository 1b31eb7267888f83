"""torpor.server: an OpenAI-compatible HTTP server with a sleep/wake control plane (`torpor serve`).

    from torpor.engine import LLM
    from torpor.server import ServerConfig, build_app
    app = build_app(LLM().engine, ServerConfig(model_name="tiny", admin_token="secret"))   # serve with uvicorn

Public: /health, GET /is_sleeping, GET /health_generate. Behind the API key when one is set:
/v1/completions, /v1/chat/completions (both streaming), /v1/models, /tokenize, /detokenize, SGLang's
/generate, /get_model_info, /get_server_info, /metrics, /openapi.json, /docs, /redoc.
Control (admin bearer token; off without one): POST /sleep?level=N&mode=wait|abort,
POST /wake_up?tags=..., POST /reload_weights (inside the allowed weights directory), GET /memory,
POST /collective_rpc, POST /release_memory_occupation, POST /resume_memory_occupation.
docs/server.md has the policies (unknown fields, strict types, SGLang tags).
"""

from torpor.server.app import build_app
from torpor.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from torpor.server.config import ServerConfig
from torpor.server.state import ServerState

__all__ = ["AsyncEngine", "EngineDeadError", "RequestStream", "ServerConfig", "ServerState",
           "build_app"]
