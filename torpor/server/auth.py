"""Bearer-token checks: the control plane needs the admin token (and is off without one); the
inference endpoints need the API key when one is configured."""

from __future__ import annotations

import hmac

from fastapi import Request

from torpor.server.errors import APIError

CONTROL_OFF = ("the control endpoints (sleep, wake_up, reload_weights, memory, ...) are off: start the server "
               "with --admin-token TOKEN or set TORPOR_ADMIN_TOKEN, then send 'Authorization: Bearer TOKEN'")


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _matches(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


async def require_api_key(request: Request) -> None:
    expected = request.app.state.server.config.api_key
    if expected is None:
        return
    given = bearer_token(request)
    if not _matches(given, expected):
        what = "no API key given" if given is None else "the API key is wrong"
        raise APIError(401, f"{what}: send 'Authorization: Bearer API_KEY'", code="invalid_api_key")


async def require_admin(request: Request) -> None:
    config = request.app.state.server.config
    if config.control_plane_auth == "none":  # opted in: open (a loopback server; logged at start)
        return
    expected = config.admin_token
    if expected is None:
        raise APIError(403, CONTROL_OFF, code="control_plane_disabled")
    given = bearer_token(request)
    if given is None:
        raise APIError(401, "the control endpoints need 'Authorization: Bearer ADMIN_TOKEN'", code="missing_token")
    if not _matches(given, expected):
        raise APIError(403, "the admin token is wrong", code="invalid_admin_token")
