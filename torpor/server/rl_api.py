"""Pause, resume, abort and weight labels for RL frameworks, with vLLM's and SGLang's routes, bodies and answers
(admin token, as the rest of the control plane):

- vLLM: `POST /pause?mode=abort|wait|keep&clear_cache=true` -> `{"status": "paused"}` (400 / 500 `{"error": str}`),
  `POST /resume` -> `{"status": "resumed"}`, `GET /is_paused` -> `{"is_paused"}`, `POST /abort_requests
  {"request_ids": [...]}` (empty or missing: every request, without pausing) -> `{"status": "aborted", "aborted": n}`,
  `GET /get_world_size?include_dp=` -> `{"world_size"}`, `GET /weight_info` -> `{"weight_version"}`.
- SGLang: `POST /pause_generation {"mode": "abort"|"retract"|"in_place"}`, `POST /continue_generation
  {"torch_empty_cache"}` -> `{"message", "status": "ok"}`, `POST /abort_request {"rid", "abort_all"}` (every
  request whose id starts with `rid`; an empty `rid` without `abort_all` does nothing) -> 200, empty.
- Both: `POST /update_weight_version {"new_version", "abort_all_requests": false}` -> `{"success": true, "message",
  "new_version"}` (the union of their answers; the weights are not touched).

The modes (`LLMEngine.pause_generation`): "abort" ends every request (their outputs, streams included, end with
finish_reason "abort" and keep their tokens); "wait" lets the running ones finish (the answer comes then; torpor's
`timeout` query bounds the wait); "keep" / "in_place" freezes them with their KV ("keep" with `clear_cache`, vLLM's
default, drops that KV: they recompute after the resume, under new weights if an update came meanwhile); "retract"
puts them back in the queue, their KV dropped. Requests that arrive while paused wait (the server's asleep timeout
applies) and run after the resume.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr, field_validator

from torpor.engine.lifecycle import check_pause_mode
from torpor.engine.weights.receiver import check_version
from torpor.server.auth import require_admin
from torpor.server.errors import APIError, SafeJSONResponse, engine_call

if TYPE_CHECKING:
    from torpor.server.state import ServerState

router = APIRouter(dependencies=[Depends(require_admin)])
VLLM_MODES = ("abort", "wait", "keep")
SGLANG_MODES = ("abort", "retract", "in_place")


class AbortRequests(BaseModel):
    model_config = ConfigDict(extra="ignore")
    request_ids: list[StrictStr] | None = None


class WeightVersion(BaseModel):
    model_config = ConfigDict(extra="ignore")
    new_version: StrictStr
    # SGLang's newest default is true; vLLM's body has no such field, and its clients must not abort: false
    abort_all_requests: StrictBool = False

    @field_validator("new_version")
    @classmethod
    def _version(cls, version: str) -> str:
        return check_version(version)


class PauseGeneration(BaseModel):
    model_config = ConfigDict(extra="ignore")
    mode: StrictStr = "abort"


class ContinueGeneration(BaseModel):
    model_config = ConfigDict(extra="ignore")
    torch_empty_cache: StrictBool = True


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    rid: StrictStr = ""
    abort_all: StrictBool = False


# ---- vLLM's ---------------------------------------------------------------------------------------
@router.post("/pause")
async def pause(request: Request, mode: str = "abort", wait_for_inflight_requests: bool = False,
                clear_cache: bool = True, timeout: float | None = None) -> SafeJSONResponse:
    """vLLM's pause (`wait_for_inflight_requests`, deprecated there, means mode "wait"); `timeout` (torpor's):
    seconds "wait" may take before the pause is undone (default: as long as the requests run)."""
    server: ServerState = request.app.state.server
    mode = "wait" if wait_for_inflight_requests else mode
    try:
        if mode not in VLLM_MODES:
            raise ValueError(f"Invalid pause mode: {mode} (vLLM's modes: {', '.join(VLLM_MODES)})")
        if timeout is not None and not 0 <= timeout < float("inf"):
            raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout}")
        await server.engine.pause_generation(mode, clear_cache, timeout)
    except ValueError as exc:
        return SafeJSONResponse({"error": str(exc)}, status_code=400)
    except Exception as exc:
        return SafeJSONResponse({"error": f"Failed to pause generation: {exc}"}, status_code=500)
    return SafeJSONResponse({"status": "paused"})


@router.post("/resume")
async def resume(request: Request) -> SafeJSONResponse:
    server: ServerState = request.app.state.server
    try:
        await server.engine.resume_generation()
    except Exception as exc:
        return SafeJSONResponse({"error": f"Failed to resume generation: {exc}"}, status_code=500)
    return SafeJSONResponse({"status": "resumed"})


@router.get("/is_paused")
async def is_paused(request: Request) -> dict:
    server: ServerState = request.app.state.server
    return {"is_paused": await engine_call(server.engine.is_paused())}


@router.post("/abort_requests")
async def abort_requests(request: Request, body: AbortRequests | None = None) -> SafeJSONResponse:
    """The named requests (the ids the server answered with), or every one when none is named; not paused."""
    server: ServerState = request.app.state.server
    try:
        aborted = await server.engine.abort_requests(body.request_ids if body and body.request_ids else None)
    except Exception as exc:
        return SafeJSONResponse({"error": f"Failed to abort requests: {exc}"}, status_code=500)
    return SafeJSONResponse({"status": "aborted", "aborted": aborted})


@router.get("/get_world_size")
async def get_world_size(request: Request, include_dp: bool = True) -> dict:
    """The engine's ranks (tensor parallel; no pipeline or data parallelism, so `include_dp` changes nothing)."""
    server: ServerState = request.app.state.server
    return {"world_size": server.engine.world_size}


@router.get("/weight_info")
async def weight_info(request: Request) -> dict:
    server: ServerState = request.app.state.server
    return {"weight_version": server.engine.weight_version}


# ---- both ---------------------------------------------------------------------------------------------
@router.post("/update_weight_version")
async def update_weight_version(body: WeightVersion, request: Request) -> dict:
    """Label the weights served (from the next step on, every token carries the label)."""
    server: ServerState = request.app.state.server
    if body.abort_all_requests:
        await engine_call(server.engine.abort_requests(None))
    await engine_call(server.engine.update_weight_version(body.new_version))
    return {"success": True, "message": f"Weight version updated to {body.new_version}",
            "new_version": body.new_version}


# ---- SGLang's -----------------------------------------------------------------------------------------
@router.post("/pause_generation")
async def pause_generation(request: Request, body: PauseGeneration | None = None) -> dict:
    server: ServerState = request.app.state.server
    mode = body.mode if body else "abort"
    if mode not in SGLANG_MODES:
        raise APIError(400, f"mode must be one of {', '.join(SGLANG_MODES)} (SGLang's), got {mode!r}", param="mode")
    await engine_call(server.engine.pause_generation(check_pause_mode(mode), clear_cache=False))
    return {"message": "Generation paused successfully.", "status": "ok"}


@router.post("/continue_generation")
async def continue_generation(request: Request, body: ContinueGeneration | None = None) -> dict:
    server: ServerState = request.app.state.server
    await engine_call(server.engine.resume_generation(body.torch_empty_cache if body else True))
    return {"message": "Generation continued successfully.", "status": "ok"}


@router.post("/abort_request")
async def abort_request(request: Request, body: AbortRequest | None = None) -> Response:
    server: ServerState = request.app.state.server
    body = body or AbortRequest()
    if body.abort_all:
        await engine_call(server.engine.abort_requests(None))
    elif body.rid:
        await engine_call(server.engine.abort_requests(prefix=body.rid))
    return Response(status_code=200)
