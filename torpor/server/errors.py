"""Errors in the OpenAI shape, `{"error": {"message", "type", "param", "code"}}`, for every failure:
validation, auth, size limits, unknown routes, engine errors. Nothing escapes as a bare 500.

Every JSON body the server sends goes through `json_text`: non-finite floats, which JSON cannot
carry, become finite (-inf -> -9999.0 as vLLM clamps logprobs, +inf -> 9999.0, nan -> -9999.0), so a
response is always valid JSON and serialization never raises after the work is done."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from torpor.engine.executor import WorkerDiedError
from torpor.memory import TorporMemoryError
from torpor.server.async_engine import EngineDeadError, EngineStepError

logger = logging.getLogger("torpor.server")

# HTTP status -> the OpenAI error type a client sees when nothing more specific applies
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
               413: "invalid_request_error", 500: "server_error", 503: "service_unavailable_error"}


NEG_INF_JSON, POS_INF_JSON = -9999.0, 9999.0  # what -inf / +inf (and nan: -9999.0) are sent as


def finite(value: Any) -> Any:
    """`value` with every non-finite float (at any depth of dicts, lists, tuples) made finite."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return POS_INF_JSON if value > 0 else NEG_INF_JSON  # nan compares false: -9999.0
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def json_text(data: Any) -> str:
    """Strict JSON (never NaN / Infinity) of `data`, non-ASCII kept as is; all escaped to ASCII if some
    text is not valid Unicode (a lone surrogate a client sent, echoed in an error), so it always
    encodes as UTF-8."""
    data = finite(data)
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(data, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text


class SafeJSONResponse(JSONResponse):
    """The server's JSON response: `json_text`, so a non-finite float cannot make it invalid."""

    def render(self, content: Any) -> bytes:
        return json_text(content).encode("utf-8")


class APIError(Exception):
    """An error answered to the client with `status` and the OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ERROR_TYPES.get(status, "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = dict(self.headers or {})
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return SafeJSONResponse(self.body(), status_code=self.status, headers=headers or None)


def engine_error(exc: BaseException) -> APIError:
    """An engine or control-plane exception as an API error: bad arguments are the client's (400), a
    request the engine's state forbids (e.g. reload while the weights sleep) is a conflict (409),
    anything else (device memory, a bug) is a server error (500) that leaves the server running."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError | WorkerDiedError):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, EngineStepError):  # the step's error (torch's text, paths) is in the server log only
        return APIError(500, "the engine failed while serving this request; the server log has the details",
                        code="engine_error")
    if isinstance(exc, ValueError | TypeError | FileNotFoundError):
        return APIError(400, str(exc))
    if is_safetensors_error(exc):  # a bad checkpoint file is the client's (11.6)
        return APIError(400, f"the checkpoint is not valid safetensors: {exc}", code="invalid_checkpoint")
    if isinstance(exc, RuntimeError) and not isinstance(exc, TorporMemoryError):
        return APIError(409, str(exc))
    logger.error("engine error", exc_info=exc)
    return APIError(500, f"internal error ({type(exc).__name__}); the server log has the details")


async def engine_call(awaitable):
    """Await an engine operation; its exception as the API error `engine_error` makes of it."""
    try:
        return await awaitable
    except Exception as exc:
        raise engine_error(exc) from None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()  # 405 keeps `Allow`

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return engine_error(exc).response()


def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic error as a 400 naming the field (`messages.0.content`)."""
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query") and not _union_tag(part)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
        return APIError(400, "the request body must be a JSON object, sent with 'Content-Type: application/json'")
    if first.get("type") == "string_unicode":  # a field name (or text) with a lone surrogate
        where = f" in {param}" if param else " in a field name"
        return APIError(400, f"invalid unicode{where}: a lone surrogate (a UTF-16 half that encodes no character)",
                        param=param, code="invalid_unicode")
    if not loc and first.get("type") == "missing":
        return APIError(400, "the request body is empty: send a JSON object with 'Content-Type: application/json'",
                        code="missing_body")
    if first.get("type") == "missing":
        return APIError(400, f"missing required field {param!r}", param=param)
    message = str(first.get("msg")).removeprefix("Value error, ")  # a validator's own message
    return APIError(400, message if param and message.startswith(param) else
                    f"{param}: {message}" if param else message, param=param)


_TYPE_NAMES = frozenset({"str", "int", "bool", "float", "dict", "list", "none", "null"})


def _union_tag(part: object) -> bool:
    """Whether a part of a pydantic error location names a member of a union (`list[int]`, `bool`, a model's
    class name) rather than a field: a client's field path leaves those out."""
    return isinstance(part, str) and ("[" in part or part in _TYPE_NAMES or part[:1].isupper())


def is_safetensors_error(exc: BaseException) -> bool:
    """Whether `exc` is safetensors' error for a file it cannot parse (truncated, garbage header)."""
    try:
        from safetensors import SafetensorError
    except ImportError:  # older safetensors: the Rust error type is not exported
        return type(exc).__name__ == "SafetensorError"
    return isinstance(exc, SafetensorError)
