"""Weights from a trainer process (admin token required), SGLang's routes and bodies:

- `POST /update_weights_from_tensor` {"serialized_named_tensors": [str, ...], "load_format": null |
  "flattened_bucket", "flush_cache": true}: tensors by reference (CUDA IPC, or shared memory on CPU).
- `POST /init_weights_update_group` {"master_address", "master_port", "rank_offset", "world_size",
  "group_name", "backend"}, `POST /update_weights_from_distributed` {"names", "dtypes", "shapes",
  "group_name", "flush_cache"}, `POST /destroy_weights_update_group` {"group_name"}: a process group
  to the trainer (its rank 0 broadcasts every tensor in order).

Both updates take SGLang's `weight_version` (the weights' label, set only when the update commits: with the request,
or a push's last; SGLang's message then says "Weight version updated to ...") and `abort_all_requests` (every
request is aborted before the update, its output ending with finish_reason "abort").

The payloads are unpickled by a restricted unpickler (torch tensors and storages only, see
torpor/engine/weights/payload.py); anything else is a 400 and is never called. Weights asleep: 409.
Success answers `{"success": true, "message", "num_tensors", "seconds", "is_sleeping", "serving"}`;
`update_weights_from_tensor` adds `timings` (torpor's extension): the engine thread's seconds per phase
(decode, check, plan, finite, copy, sync, release, ..., total) and, for a request staged off the engine
thread, the staging thread's (stage_decode, ..., stage), which `torpor bench weights` prints. torpor's optional
headers `X-Torpor-Push-Id` / `X-Torpor-Push-Index` make requests one push: applied in index order, none after
the first that failed, and one weight update: the engine never serves part of it (weight_pipeline.py).
`update_weights_from_distributed` receives off the engine thread: requests keep being served on the old weights
until every tensor arrived; a trainer that stops broadcasting is given up after `timeout` seconds (default: the
group's).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

from torpor.engine.weights.receiver import check_version
from torpor.engine.weights.transport import DEFAULT_GROUP_TIMEOUT_S
from torpor.server import weight_pipeline
from torpor.server.auth import require_admin
from torpor.server.errors import APIError, engine_call

if TYPE_CHECKING:
    from torpor.server.state import ServerState

router = APIRouter(dependencies=[Depends(require_admin)])
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group name


class UpdateRequest(BaseModel):
    """What both updates share: SGLang's label of the new weights and its abort-first."""

    weight_version: StrictStr | None = None
    abort_all_requests: StrictBool = False

    @field_validator("weight_version")
    @classmethod
    def _version(cls, version: str | None) -> str | None:
        return None if version is None else check_version(version)


class UpdateFromTensorRequest(UpdateRequest):
    model_config = ConfigDict(extra="ignore")  # SGLang clients send more (disable_draft_model, ...)
    serialized_named_tensors: list[StrictStr]
    load_format: StrictStr | None = None
    flush_cache: StrictBool = True


class InitGroupRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    master_address: StrictStr
    master_port: StrictInt | StrictStr  # SGLang's own test sends it as a string of digits
    rank_offset: StrictInt
    world_size: StrictInt
    group_name: StrictStr = DEFAULT_GROUP
    backend: StrictStr | None = None  # None: nccl on GPU, gloo on CPU
    timeout: StrictFloat | StrictInt = DEFAULT_GROUP_TIMEOUT_S  # seconds for the group to form (torpor's)

    @field_validator("master_port")
    @classmethod
    def _port(cls, port: int | str) -> int:
        if isinstance(port, str):
            if not port.isdigit() or len(port) > 5:
                raise ValueError("master_port must be a port number (an integer, or a string of digits)")
            port = int(port)
        return port


class UpdateFromDistributedRequest(UpdateRequest):
    model_config = ConfigDict(extra="ignore")
    names: list[StrictStr]
    dtypes: list[StrictStr]
    shapes: list[list[StrictInt]]
    group_name: StrictStr = DEFAULT_GROUP
    flush_cache: StrictBool = True
    timeout: StrictFloat | StrictInt = DEFAULT_GROUP_TIMEOUT_S  # seconds the broadcasts may take (torpor's)
    # SGLang's "flattened_bucket" here is one broadcast of every tensor at once: refused (one per tensor only)
    load_format: None = None


class DestroyGroupRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    group_name: StrictStr = DEFAULT_GROUP


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(body: UpdateFromTensorRequest, request: Request) -> dict:
    try:
        push = weight_pipeline.push_position(request.headers)  # torpor's extension: a push in flight
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    return await _update_from_tensor(request.app.state.server, **body.model_dump(), push=push)


@router.post("/init_weights_update_group")
async def init_weights_update_group(body: InitGroupRequest, request: Request) -> dict:
    return await _init_group(request.app.state.server, **body.model_dump())


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(body: UpdateFromDistributedRequest, request: Request) -> dict:
    return await _update_from_distributed(request.app.state.server, **body.model_dump())


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(body: DestroyGroupRequest, request: Request) -> dict:
    return await _destroy_group(request.app.state.server, **body.model_dump())


async def _update_from_tensor(server: ServerState, serialized_named_tensors: list[str], load_format: str | None = None,
                              flush_cache: bool = True, push: weight_pipeline.PushPosition | None = None,
                              weight_version: str | None = None, abort_all_requests: bool = False,
                              **_: Any) -> dict:
    """Opened and checked off the engine thread, copied on it, in the push's order (weight_pipeline.py)."""
    start = time.perf_counter()
    if abort_all_requests:
        await engine_call(server.engine.abort_requests(None))
    if server.weights is None:
        server.weights = weight_pipeline.WeightPipeline(server.engine, server.config.push_idle_timeout_s)
    count, timings = await engine_call(server.weights.update(serialized_named_tensors, load_format, flush_cache,
                                                             push, weight_version))
    labelled = weight_version if push is None or push.last else None
    return {**_done(server, f"loaded {count} tensors", start, count, labelled), "timings": timings}


async def _init_group(server: ServerState, master_address: str, master_port: int, rank_offset: int, world_size: int,
                      group_name: str = DEFAULT_GROUP, backend: str | None = None,
                      timeout: float = DEFAULT_GROUP_TIMEOUT_S, **_: Any) -> dict:
    start = time.perf_counter()
    await engine_call(server.engine.init_weights_update_group(master_address, master_port, rank_offset, world_size,
                                                              group_name, backend, timeout))
    return _done(server, f"joined weights update group {group_name!r}", start)


async def _update_from_distributed(server: ServerState, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                   group_name: str = DEFAULT_GROUP, flush_cache: bool = True,
                                   timeout: float = DEFAULT_GROUP_TIMEOUT_S, weight_version: str | None = None,
                                   abort_all_requests: bool = False, **_: Any) -> dict:
    start = time.perf_counter()
    if abort_all_requests:
        await engine_call(server.engine.abort_requests(None))
    count = await engine_call(server.engine.update_weights_from_distributed(names, dtypes, shapes, group_name,
                                                                            flush_cache, timeout, weight_version))
    return _done(server, f"loaded {count} tensors", start, count, weight_version)


async def _destroy_group(server: ServerState, group_name: str = DEFAULT_GROUP, **_: Any) -> dict:
    start = time.perf_counter()
    await engine_call(server.engine.destroy_weights_update_group(group_name))
    return _done(server, f"destroyed weights update group {group_name!r}", start)


def _done(server: ServerState, message: str, start: float, count: int | None = None,
          version: str | None = None) -> dict:
    if version is not None:
        message += f". Weight version updated to {version}."  # SGLang's words
    return {"success": True, "message": message, "num_tensors": count, "seconds": time.perf_counter() - start,
            **server.engine.state_fields()}


# `POST /collective_rpc {"method": ...}` reaches these too (control.py adds them to its allowlist).
RPC_METHODS = {"update_weights_from_tensor": _update_from_tensor, "init_weights_update_group": _init_group,
               "update_weights_from_distributed": _update_from_distributed,
               "destroy_weights_update_group": _destroy_group}
