"""The control plane (admin token required): sleep, wake, reload, memory, plus the aliases RL
frameworks already call (`/collective_rpc`, `/release_memory_occupation`, `/resume_memory_occupation`).

Every operation runs in the engine thread between steps and answers once it is complete, with the
engine's state after it: `is_sleeping` (a sleep level is set) and `serving` (requests run: every tag
awake and the weights valid).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from torpor.engine.sleep_mode import SLEEP_TAGS
from torpor.server.auth import require_admin
from torpor.server.errors import APIError, engine_error

if TYPE_CHECKING:
    from torpor.memory import Report
    from torpor.server.app import ServerState

router = APIRouter(dependencies=[Depends(require_admin)])


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str | None = None


class TagsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tags: list[str] | None = None


class RPCRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)


@router.post("/sleep")
async def sleep(request: Request, level: int = 1, mode: str = "wait") -> dict:
    """Sleep at `level` (0 pause, 1 offload weights, 2 discard weights); `mode`: running requests
    finish first ("wait") or are aborted ("abort")."""
    return await _sleep(request.app.state.server, level, mode)


@router.post("/wake_up")
async def wake_up(request: Request, tags: Annotated[list[str] | None, Query()] = None) -> dict:
    """Wake the given tags (repeat `tags=`), or everything."""
    return await _wake(request.app.state.server, tags)


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict:
    server: ServerState = request.app.state.server
    return {"is_sleeping": await _run(server.engine.is_sleeping())}


@router.post("/reload_weights")
async def reload_weights(request: Request, body: ReloadRequest | None = None) -> dict:
    """Reload the checkpoint (or the one at `path`) into the same weight tensors."""
    return await _reload(request.app.state.server, body.path if body else None)


@router.get("/memory")
async def memory(request: Request) -> dict:
    server: ServerState = request.app.state.server
    return await _run(server.engine.memory_usage())


@router.post("/collective_rpc")
async def collective_rpc(body: RPCRequest, request: Request) -> dict:
    """vLLM's form: {"method": name, "args": [...], "kwargs": {...}}; one result (one worker)."""
    server: ServerState = request.app.state.server
    methods = {"sleep": _sleep, "wake_up": _wake, "reload_weights": _reload, "is_sleeping": _is_sleeping,
               "memory_usage": _memory_usage}
    from torpor.server.weights_api import RPC_METHODS  # weights from a trainer (a cycle at import time)
    methods.update(RPC_METHODS)
    method = methods.get(body.method)
    if method is None:
        raise APIError(400, f"unknown method {body.method!r}; this server supports {sorted(methods)}",
                       param="method")
    try:
        result = await method(server, *body.args, **body.kwargs)
    except TypeError as exc:
        raise APIError(400, f"bad arguments for {body.method}: {exc}", param="kwargs") from None
    return {"results": [result]}


@router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request, body: TagsRequest | None = None) -> dict:
    """SGLang's form. Releases at sleep level 1 whatever tags are named (the engine sleeps as a whole;
    `tags` is checked for compatibility)."""
    _check_tags(body.tags if body else None)
    return {"success": True, **await _sleep(request.app.state.server, 1, "wait")}


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request, body: TagsRequest | None = None) -> dict:
    """SGLang's form: wake the named tags, or everything."""
    return {"success": True, **await _wake(request.app.state.server, body.tags if body else None)}


async def _sleep(server: ServerState, level: int = 1, mode: str = "wait") -> dict:
    if mode not in ("wait", "abort"):
        raise APIError(400, f"mode must be 'wait' (running requests finish first) or 'abort', got {mode!r}",
                       param="mode")
    start = time.perf_counter()
    report = await _run(server.engine.sleep(level, mode))
    seconds = time.perf_counter() - start
    server.metrics.sleeps.labels(str(level)).inc()
    server.metrics.sleep_seconds.observe(seconds)
    return {"level": level, **_state(server), "seconds": seconds, "report": _report(report)}


async def _wake(server: ServerState, tags: list[str] | None = None) -> dict:
    _check_tags(tags)
    start = time.perf_counter()
    result = await _run(server.engine.wake_up(tags))
    seconds = time.perf_counter() - start
    server.metrics.wakes.inc()
    server.metrics.wake_seconds.observe(seconds)
    return {"woken": list(result.woken), **_state(server), "seconds": seconds, "report": _report(result.report)}


async def _reload(server: ServerState, path: str | None = None) -> dict:
    if path is not None and (not isinstance(path, str) or not path):
        raise APIError(400, f"path must be a non-empty string, got {path!r}", param="path")
    start = time.perf_counter()
    await _run(server.engine.reload_weights(path))
    return {**_state(server), "seconds": time.perf_counter() - start}


async def _is_sleeping(server: ServerState) -> bool:
    return await _run(server.engine.is_sleeping())


async def _memory_usage(server: ServerState) -> dict:
    return await _run(server.engine.memory_usage())


async def _run(awaitable):
    try:
        return await awaitable
    except Exception as exc:
        raise engine_error(exc) from None


def _check_tags(tags: list[str] | None) -> None:
    if tags is None:
        return
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise APIError(400, f"tags must be a list of tag names, got {tags!r}", param="tags")
    unknown = sorted(set(tags) - set(SLEEP_TAGS))
    if unknown:
        raise APIError(400, f"unknown tag(s) {unknown}; the engine's tags are {list(SLEEP_TAGS)}", param="tags")


def _state(server: ServerState) -> dict:
    return {"is_sleeping": server.engine.sleeping, "serving": server.engine.serving}


def _report(report: Report | None) -> dict | None:
    if report is None:
        return None
    return {"kind": report.kind, "seconds": report.seconds, "bytes_copied": report.bytes_copied,
            "bytes_released": report.bytes_released, "bytes_mapped": report.bytes_mapped,
            "tags": [{"tag": t.tag, "action": str(t.action), "bytes_copied": t.bytes_copied,
                      "bytes_released": t.bytes_released, "bytes_mapped": t.bytes_mapped} for t in report.tags]}
