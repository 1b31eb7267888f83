"""Pure ASGI middleware (they keep streaming and client-disconnect detection intact): a request-body
size limit, and request counts by route and status."""

from __future__ import annotations

from collections.abc import Callable, Collection

from torpor.server.errors import APIError


class BodyLimit:
    """Answers 413 to a body larger than `max_bytes` (declared or streamed) before the app sees it; a
    body within the limit is buffered and replayed to the app."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await _send_error(send, APIError(400, "the Content-Length header is not a number"))
            if int(declared) > self.max_bytes:
                return await _send_error(send, self._too_large(int(declared)))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await _send_error(send, self._too_large(size))
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # later calls report the client's disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    def _too_large(self, size: int) -> APIError:
        return APIError(413, f"the request body has {size} bytes or more; this server accepts at most "
                             f"{self.max_bytes} (--max-body-bytes)", code="request_too_large")


class CountRequests:
    """Counts every HTTP request by route (unknown paths as "other") and status code."""

    def __init__(self, app, count: Callable[[str, str], None], routes: Collection[str]) -> None:
        self.app, self.count, self.routes = app, count, routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = "500"

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            path = scope["path"]
            self.count(path if path in self.routes else "other", status)


async def _send_error(send, error: APIError) -> None:
    response = error.response()
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})
