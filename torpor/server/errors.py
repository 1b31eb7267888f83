"""Errors in the OpenAI shape, `{"error": {"message", "type", "param", "code"}}`, for every failure:
validation, auth, size limits, unknown routes, engine errors. Nothing escapes as a bare 500."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger("torpor.server")

# HTTP status -> the OpenAI error type a client sees when nothing more specific applies
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
               413: "invalid_request_error", 500: "server_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """An error answered to the client with `status` and the OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ERROR_TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def engine_error(exc: BaseException) -> APIError:
    """An engine or control-plane exception as an API error: bad arguments are the client's (400), a
    request the engine's state forbids (e.g. reload while the weights sleep) is a conflict (409),
    anything else (device memory, a bug) is a server error (500) that leaves the server running."""
    from torpor.memory import TorporMemoryError
    from torpor.server.async_engine import EngineDeadError, EngineStepError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc), code="engine_error")
    if isinstance(exc, ValueError | TypeError | FileNotFoundError):
        return APIError(400, str(exc))
    if isinstance(exc, RuntimeError) and not isinstance(exc, TorporMemoryError):
        return APIError(409, str(exc))
    logger.error("engine error", exc_info=exc)
    return APIError(500, f"engine error: {type(exc).__name__}: {exc}")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return engine_error(exc).response()


def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic error as a 400 naming the field (`messages.0.content`)."""
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query")]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
        return APIError(400, "the request body must be a JSON object, sent with 'Content-Type: application/json'")
    if first.get("type") == "missing":
        return APIError(400, f"missing required field {param!r}", param=param)
    return APIError(400, f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param=param)
