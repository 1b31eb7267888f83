"""vLLM's native weight transfer over HTTP (admin token required), vLLM's routes, bodies and answers
(`vllm/entrypoints/serve/dev/rlhf/api_router.py`):

- `POST /init_weight_transfer_engine {"init_info": {...}}` -> `{"message": "Weight transfer initialized"}`
- `POST /start_weight_update` (no body; or vLLM's variants' `{"include_draft": false}`, `{"is_checkpoint_format":
  true}`) -> `{"message": "Weight update started"}`
- `POST /update_weights {"update_info": {...}}` -> `{"message": "Weights updated"}` once every rank received and
  copied the chunk (nccl: after the trainer's broadcast, which it runs while this request is pending)
- `POST /finish_weight_update` (optional `{"weight_version": str}`) -> `{"message": "Weight update finished"}`
(`GET /get_world_size`, what a trainer sizes the nccl group with, is in rl_api.py.)

The engine's rule (engine/weights/transfer.py): nothing runs from start to finish, a chunk refused or failed ends
the update as a failure, and an update with no call for `push_idle_timeout_s` is given up (its trainer died or
stalled): the old weights serve again (from their host copy), never a mix. Errors are torpor's error shape: 400 for
a bad body or info (naming the field), 409 for a call out of order (no update in progress, one ended, weights
asleep, the group given up).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr

from torpor.server.auth import require_admin
from torpor.server.errors import APIError, engine_call

if TYPE_CHECKING:
    from torpor.server.state import ServerState

logger = logging.getLogger("torpor.server")
router = APIRouter(dependencies=[Depends(require_admin)])


class InitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    init_info: dict[str, Any]


class StartRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_draft: StrictBool = False  # vLLM's variant without /start_draft_weight_update
    is_checkpoint_format: StrictBool = True  # TRL's async client, vLLM's examples


class UpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    update_info: dict[str, Any]


class FinishRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weight_version: StrictStr | None = None


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(body: InitRequest, request: Request) -> dict:
    await engine_call(request.app.state.server.engine.init_weight_transfer_engine(body.init_info))
    return {"message": "Weight transfer initialized"}


@router.post("/start_weight_update")
async def start_weight_update(request: Request, body: StartRequest | None = None) -> dict:
    server: ServerState = request.app.state.server
    body = body or StartRequest()
    update_id = await engine_call(server.engine.start_weight_update(body.include_draft, body.is_checkpoint_format))
    _idle_timer(server, update_id)
    return {"message": "Weight update started"}


@router.post("/start_draft_weight_update")
async def start_draft_weight_update(request: Request) -> dict:
    raise APIError(400, "start_draft_weight_update: this engine has no draft model", code="unsupported_parameter")


@router.post("/update_weights")
async def update_weights(body: UpdateRequest, request: Request) -> dict:
    server: ServerState = request.app.state.server
    if "ipc_handles" in body.update_info:
        raise APIError(400, "update_info.ipc_handles cannot travel as JSON: send them as ipc_handles_pickled (base64 "
                            "of their pickle; vLLM's HTTP client does)", param="update_info.ipc_handles")
    update_id = server.transfer_update
    _cancel_timer(server)  # a chunk in progress is no idle trainer
    try:
        await engine_call(server.engine.update_weights_transfer(body.update_info))
    finally:
        if update_id is not None and server.engine.transfer_in_progress(update_id):
            _idle_timer(server, update_id)
    return {"message": "Weights updated"}


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request, body: FinishRequest | None = None) -> dict:
    server: ServerState = request.app.state.server
    await engine_call(server.engine.finish_weight_update((body or FinishRequest()).weight_version))
    _cancel_timer(server)
    server.transfer_update = None
    return {"message": "Weight update finished"}


# ---- the idle timeout of an update in progress ------------------------------------------------------------
def _idle_timer(server: ServerState, update_id: str) -> None:
    """Give `update_id` up after `push_idle_timeout_s` with no call of it (restarted by each call)."""
    _cancel_timer(server)
    seconds = server.config.push_idle_timeout_s
    server.transfer_update = update_id
    server.transfer_timer = asyncio.get_running_loop().call_later(seconds, _give_up, server, update_id, seconds)


def _cancel_timer(server: ServerState) -> None:
    if server.transfer_timer is not None:
        server.transfer_timer.cancel()
        server.transfer_timer = None


def _give_up(server: ServerState, update_id: str, seconds: float) -> None:
    server.transfer_timer = None
    if server.engine.alive:
        server.engine.submit(server.engine.abandon_transfer, update_id,
                             f"no call of it came for {seconds:g} s (push_idle_timeout_s)")
