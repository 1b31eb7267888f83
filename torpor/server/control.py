"""The control plane: sleep, wake, reload, memory, plus the aliases RL frameworks already call (`/collective_rpc`,
`/release_memory_occupation`, `/resume_memory_occupation`, `/reset_prefix_cache`, `/flush_cache`). Every endpoint
needs the admin token except `GET /is_sleeping`, which is public (vLLM clients and RL frameworks poll it, and it
tells nothing but a boolean). Pause, resume, abort and weight labels are in rl_api.py.

Every operation runs in the engine thread between steps and answers once it is complete, with the engine's state
after it: `is_sleeping` (a sleep level is set) and `serving` (requests run). Levels, modes and tags are checked by
the engine (`torpor.engine.lifecycle`); their errors are 400s naming the parameter.

`/reload_weights {"path": ...}` reads only inside the allowed weights directory (`--allowed-weights-dir`, default:
the served model's parent folder), compared after resolving symlinks: a path outside is a 403, and a path inside
that holds no loadable checkpoint gets one generic 400 whether or not it exists.

SGLang's `POST /update_weights_from_disk {"model_path", ...}` (its `UpdateWeightFromDiskReqInput`, every field honoured
or refused by name) is such a reload, answered `{"success": true, "message", "num_paused_requests"}`; its
`GET|POST /get_weights_by_name {"name", "truncate_size": 100}` answers the tensor as the engine holds it,
`tensor.float().tolist()[:truncate_size]` (its first rows), what SGLang's tests compare after an update.

SGLang's memory-occupation tags are engine tags of the same name: `weights` (offloaded: a host copy is kept, as
SGLang's `enable_weights_cpu_backup`), `kv_cache` (discarded), `cuda_graph` (offloaded); the engine's own `runtime`
and `workspace` tags may be named too. `release_memory_occupation` with `tags` releases only those (each with its
level-1 action); without `tags` it sleeps at level 1. `resume_memory_occupation` wakes the named tags (any wake also
restores runtime, workspace and cuda_graph), or everything. As SGLang's, they refuse (400 naming the tags) a
release of a tag released already and a resume of one that is not (`weights` and `kv_cache`; the others, which
any wake restores, only while nothing sleeps); vLLM's `/sleep` and `/wake_up` keep their no-op semantics.

vLLM's `/reset_prefix_cache?reset_running_requests=&reset_external=` always resets (the running requests recompute
first when asked); SGLang's `/flush_cache?timeout=` resets only once no request runs or waits, waiting up to
`timeout` seconds (default 0) for that, else a 400 with SGLang's text.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from torpor.engine import rpc
from torpor.engine.lifecycle import SLEEP_TAGS, check_level, check_mode, check_tags
from torpor.engine.weights.index import INDEX_FILE, SINGLE_FILE, CheckpointError, checkpoint_files
from torpor.server.auth import require_admin
from torpor.server.errors import APIError, SafeJSONResponse, engine_call, engine_error, is_safetensors_error, json_text
from torpor.server.protocol import invalid_unicode
from torpor.server.weights_api import RPC_METHODS as WEIGHT_METHODS

if TYPE_CHECKING:
    from torpor.memory import Report
    from torpor.server.state import ServerState

router = APIRouter(dependencies=[Depends(require_admin)])
public_router = APIRouter()  # GET /is_sleeping
SGLANG_TAGS = {"weights": ("weights",), "kv_cache": ("kv_cache",), "cuda_graph": ("cuda_graph",)}
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, "
           "the operation will not be performed.)\n")  # SGLang's answer
NO_CHECKPOINT = ("no loadable checkpoint at that path (a folder with config-compatible *.safetensors weights, "
                 "inside the allowed weights directory)")


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: StrictStr | None = None


class TagsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tags: list[StrictStr] | None = None


class RPCRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: StrictStr
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: StrictFloat | StrictInt | None = None  # vLLM's: seconds each rank may take (tensor parallel)


class UpdateFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # SGLang's fields: each honoured or refused by name
    model_path: StrictStr
    load_format: StrictStr | None = None
    abort_all_requests: StrictBool = False
    weight_version: StrictStr | None = None
    is_async: StrictBool = False
    torch_empty_cache: StrictBool = False
    keep_pause: StrictBool = False
    recapture_cuda_graph: StrictBool = False  # the graphs read the weights in place: they see the new ones
    token_step: StrictInt = 0
    flush_cache: StrictBool = True
    manifest: dict[str, Any] | None = None
    rid: StrictStr | None = None  # SGLang's BaseReq: one server, nothing to route


class WeightsByNameRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr
    truncate_size: StrictInt = 100
    rid: StrictStr | None = None


# What torpor does not do of SGLang's reload, refused by name when asked for: (field, its default, why).
_DISK_REFUSED = (
    ("is_async", False, "the reload answers once the new weights serve"),
    ("keep_pause", False, "the reload pauses nothing: requests wait while it loads, then run"),
    ("token_step", 0, "torpor labels weights with weight_version only"),
    ("manifest", None, "the checkpoint's own safetensors headers are its manifest"),
)


@router.post("/sleep")
async def sleep(request: Request, level: int = 1, mode: str = "wait") -> dict:
    """Sleep at `level` (0 pause, 1 offload weights, 2 discard weights, 3 and 4: 1 and 2 plus the CUDA
    context released); `mode`: running requests finish first ("wait"), are aborted ("abort") or kept ("keep":
    they continue after the wake; vLLM's default is "abort")."""
    return await _sleep(request.app.state.server, level, mode)


@router.post("/wake_up")
async def wake_up(request: Request, tags: Annotated[list[str] | None, Query()] = None) -> dict:
    """Wake the given tags (repeat `tags=`), or everything."""
    return await _wake(request.app.state.server, tags)


@public_router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict:
    """Whether a sleep level is set (public: no token needed)."""
    server: ServerState = request.app.state.server
    return {"is_sleeping": await engine_call(server.engine.is_sleeping())}


@router.post("/reload_weights")
async def reload_weights(request: Request, body: ReloadRequest | None = None) -> dict:
    """Reload the checkpoint (or the one at `path`, inside the allowed weights directory) into the same weight
    tensors."""
    return await _reload(request.app.state.server, body.path if body else None)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateFromDiskRequest, request: Request) -> dict:
    """SGLang's reload from a checkpoint folder (inside the allowed weights directory)."""
    server: ServerState = request.app.state.server
    if body.load_format not in (None, "auto"):
        raise APIError(400, f"load_format {body.load_format!r} is not supported (null or 'auto': the folder's "
                            "safetensors)", param="load_format", code="unsupported_parameter")
    for name, default, why in _DISK_REFUSED:
        if getattr(body, name) != default:
            raise APIError(400, f"{name}={getattr(body, name)!r} is not supported: {why}", param=name,
                           code="unsupported_parameter")
    path = allowed_checkpoint_path(body.model_path, server.allowed_weights_dir)
    start = time.perf_counter()
    held = await _loading(server.engine.update_weights_from_disk(path, body.weight_version, body.abort_all_requests,
                                                                 body.flush_cache, body.torch_empty_cache), server,
                          "model_path")
    return {"success": True, "message": f"Succeeded to update model weights from {body.model_path} in "
                                        f"{time.perf_counter() - start:.3f} s", "num_paused_requests": held}


@router.post("/get_weights_by_name", operation_id="get_weights_by_name")
@router.get("/get_weights_by_name", operation_id="get_weights_by_name_get")
async def get_weights_by_name(body: WeightsByNameRequest, request: Request) -> list:
    """SGLang's: the tensor as the engine holds it, its first `truncate_size` rows (float32 values)."""
    if body.truncate_size < 0:
        raise APIError(400, "truncate_size must be >= 0", param="truncate_size")
    return await engine_call(request.app.state.server.engine.get_weights_by_name(body.name, body.truncate_size))


@router.get("/memory")
async def memory(request: Request) -> dict:
    server: ServerState = request.app.state.server
    return await engine_call(server.engine.memory_usage())


@router.post("/collective_rpc")
async def collective_rpc(body: RPCRequest, request: Request) -> Response:
    """vLLM's form: {"method": name, "args": [...], "kwargs": {...}, "timeout": seconds}; one result per rank,
    `{"results": [...]}`. The engine's methods and their arguments: sleep(level: int = 1, mode: str = "wait"),
    wake_up(tags: list[str] | None = None), reload_weights(path: str | None = None), is_sleeping(),
    memory_usage(), and the weight-update calls; any other name is a Worker method the Worker offers (its readings, a
    worker extension's methods), called with the JSON values as they come, as vLLM does, its results as vLLM
    answers them (null, objects and lists as they are, anything else as its str())."""
    server: ServerState = request.app.state.server

    methods = {**RPC_METHODS, **WEIGHT_METHODS}
    if body.method not in rpc.METHODS:
        try:
            results = await engine_call(server.engine.worker_rpc(body.method, tuple(body.args), body.kwargs or None,
                                                                 body.timeout))
        except APIError as exc:
            cause = exc.__context__
            if isinstance(cause, rpc.RPCArgumentError):
                exc.param = cause.param
            raise
        return SafeJSONResponse({"results": [_vllm_result(r) for r in results]})
    try:  # the engine's table and argument checks, shared with LLM.collective_rpc
        bound = rpc.check(body.method, body.args, body.kwargs)
    except rpc.RPCArgumentError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    method = methods.get(body.method)
    if method is None:
        raise APIError(400, f"{body.method} is not available over HTTP; this server supports {sorted(methods)}",
                       param="method")
    result = await method(server, *list(bound.args)[1:], **bound.kwargs)
    return SafeJSONResponse({"results": [result] * server.engine.config.tensor_parallel_size})


def _vllm_result(result: Any) -> Any:
    """vLLM's answer of one rank's result: None, a dict or a list as it is (if JSON can hold it), else str()."""
    if result is None or isinstance(result, dict | list):
        try:
            json_text(result)
            return result
        except (TypeError, ValueError):
            pass
    return str(result)


@router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request, body: TagsRequest | None = None) -> dict:
    """SGLang's form: release the named tags only (see the module docstring), or sleep at level 1."""
    server: ServerState = request.app.state.server
    tags = body.tags if body else None
    if tags is None:
        return {"success": True, **await _sleep(server, 1, "wait")}
    return {"success": True, **await _release(server, _engine_tags(tags))}


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request, body: TagsRequest | None = None) -> dict:
    """SGLang's form: wake the named tags, or everything."""
    tags = body.tags if body else None
    server: ServerState = request.app.state.server
    return {"success": True, **await _wake(server, None if tags is None else _engine_tags(tags), strict=True)}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request, reset_running_requests: bool = False,
                             reset_external: bool = False) -> dict:
    """vLLM's form: forget every KV block cached for prefix reuse; `reset_running_requests`: the running requests
    recompute their KV (back to the waiting queue first); `reset_external`: accepted (no external KV connector)."""
    server: ServerState = request.app.state.server
    return {"success": await engine_call(server.engine.reset_prefix_cache(reset_running_requests))}


@router.post("/flush_cache", operation_id="flush_cache")
@router.get("/flush_cache", operation_id="flush_cache_get")
async def flush_cache(request: Request, timeout: float = 0.0) -> PlainTextResponse:
    """SGLang's: reset the prefix cache once no request runs or waits, waiting up to `timeout` seconds for that;
    SGLang's text, 200, or 400 when requests still ran (SGLang serves it for GET and POST; verl GETs it until 200)."""
    if not 0 <= timeout < float("inf"):
        raise APIError(400, f"timeout must be a number of seconds >= 0, got {timeout}", param="timeout")
    server: ServerState = request.app.state.server
    flushed, why = await engine_call(server.engine.flush_cache(timeout))
    return PlainTextResponse(FLUSHED if flushed else why + "\n", status_code=200 if flushed else 400)


# ---- the operations -----------------------------------------------------------------------------
async def _sleep(server: ServerState, level: int = 1, mode: str = "wait") -> dict:
    _checked(check_level, level, "level")
    _checked(check_mode, mode, "mode")
    result = await engine_call(server.engine.sleep(level, mode))
    return _answer(server, "sleep", result.seconds, result.report, level=level, changed=result.changed,
                   sleep_level=level)


async def _release(server: ServerState, tags: list[str]) -> dict:
    result = await engine_call(server.engine.release_tags(tags, "wait", strict=True))
    released = [t.tag for t in result.report.tags] if result.report is not None else []
    return _answer(server, "sleep", result.seconds, result.report, level=result.level, released=released,
                   changed=result.changed, sleep_level=1)


async def _wake(server: ServerState, tags: list[str] | None = None, strict: bool = False) -> dict:
    if tags is not None:  # vLLM's virtual "scheduling" ends a level-0 sleep
        _checked(lambda named: check_tags(named, (*SLEEP_TAGS, "scheduling")), tags, "tags")
    result = await engine_call(server.engine.wake_up(tags, strict))
    return _answer(server, "wake", result.seconds, result.report, woken=list(result.woken), changed=True)


async def _reload(server: ServerState, path: str | None = None) -> dict:
    checkpoint = None if path is None else allowed_checkpoint_path(path, server.allowed_weights_dir)
    seconds = await _loading(server.engine.reload_weights(checkpoint), server, "path")
    return _answer(server, "reload", seconds, None)


async def _loading(awaitable, server: ServerState, param: str):
    """A reload's result, its failures as answers: a path that holds no checkpoint one generic 400, so nothing is
    learnt about the disk; a checkpoint that cannot be loaded a 400 naming the problem and what serves now."""
    try:
        return await awaitable
    except OSError:  # missing, not a folder, unreadable
        raise APIError(400, NO_CHECKPOINT, param=param, code="invalid_checkpoint") from None
    except Exception as exc:
        # the loader's CheckpointError (a ValueError: bad file, shape, dtype, index), or safetensors' own
        if isinstance(exc, ValueError) or is_safetensors_error(exc):
            state = server.engine.state_fields()
            serving = "the engine serves the previous weights" if state["serving"] else \
                "the engine does not serve until a reload or a complete update succeeds"
            raise APIError(400, f"the checkpoint cannot be loaded: {exc} ({serving})", param=param,
                           code="invalid_checkpoint") from None
        raise engine_error(exc) from None


async def _is_sleeping(server: ServerState) -> bool:
    return await engine_call(server.engine.is_sleeping())


async def _memory_usage(server: ServerState) -> dict:
    return await engine_call(server.engine.memory_usage())


# The engine's collective_rpc methods served over HTTP (their arguments are checked by engine/rpc.py).
RPC_METHODS = {"sleep": _sleep, "wake_up": _wake, "reload_weights": _reload, "is_sleeping": _is_sleeping,
               "memory_usage": _memory_usage}


# ---- helpers --------------------------------------------------------------------------------------
def allowed_checkpoint_path(path: str, allowed_dir: Path) -> str:
    """`path` with its symlinks resolved, if it lies inside `allowed_dir` (itself resolved) and so does every
    file the loader would open in it (the index, the single file, each shard the index lists: a symlink may
    not lead out); a 403 otherwise. Nothing is said about whether the path exists (the reload says what is
    wrong with a folder that is not a checkpoint)."""
    if not path or "\x00" in path or invalid_unicode(path) is not None:
        raise APIError(400, "path must be a non-empty folder path (valid Unicode, no NUL)", param="path")
    resolved = Path(os.path.realpath(path))
    try:
        shards = checkpoint_files(resolved) if resolved.is_relative_to(allowed_dir) else []
    except (OSError, CheckpointError):
        shards = []
    files = (resolved, *(Path(os.path.realpath(f)) for f in (resolved / INDEX_FILE, resolved / SINGLE_FILE, *shards)))
    if not all(file.is_relative_to(allowed_dir) for file in files):
        raise APIError(403, f"reloading from outside the allowed weights directory {str(allowed_dir)!r} is refused "
                            "(start the server with --allowed-weights-dir to allow another folder)",
                       param="path", code="path_not_allowed")
    return str(resolved)


def _engine_tags(tags: list[str]) -> list[str]:
    """SGLang tag names (and engine tag names) as engine tags; a 400 naming unknown ones."""
    unknown = sorted({t for t in tags if t not in SGLANG_TAGS and t not in SLEEP_TAGS})
    if unknown:
        raise APIError(400, f"unknown tag(s) {unknown}; SGLang's tags are {list(SGLANG_TAGS)} and the engine's "
                            f"{list(SLEEP_TAGS)}", param="tags")
    return sorted({engine_tag for t in tags for engine_tag in SGLANG_TAGS.get(t, (t,))}, key=SLEEP_TAGS.index)


def _checked(check, value, param: str):
    """The engine's own check of a control parameter, as a 400 naming it."""
    try:
        return check(value)
    except ValueError as exc:
        raise APIError(400, str(exc), param=param) from None


def _answer(server: ServerState, kind: str, seconds: float, report: Report | None, changed: bool = False,
            sleep_level: int | None = None, **fields: Any) -> dict:
    """A control answer: the operation's fields, the engine's state after it, `seconds` (the whole operation on the
    engine thread), the memory layer's report (its `seconds`: the memory's part), and the metrics of a sleep or wake
    that changed something (a no-op sleep, same or shallower level, is not counted)."""
    if kind == "sleep" and changed:
        server.metrics.sleeps.labels(str(sleep_level)).inc()
        server.metrics.sleep_seconds.observe(seconds)
    elif kind == "wake":
        server.metrics.wakes.inc()
        server.metrics.wake_seconds.observe(seconds)
    return {**fields, **server.engine.state_fields(), "seconds": seconds, "report": _report(report)}


def _report(report: Report | None) -> dict | None:
    if report is None:
        return None
    return {"kind": report.kind, "seconds": report.seconds, "bytes_copied": report.bytes_copied,
            "bytes_released": report.bytes_released, "bytes_mapped": report.bytes_mapped,
            "tags": [{"tag": t.tag, "action": str(t.action), "bytes_copied": t.bytes_copied,
                      "bytes_released": t.bytes_released, "bytes_mapped": t.bytes_mapped} for t in report.tags]}
