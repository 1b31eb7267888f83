"""Load Hugging Face safetensors checkpoints into a model's existing parameters, in place.

Parameters are never re-allocated (every tensor is copied into the parameter it belongs to), so the
same calls serve the first load, a reload after the weights' memory was discarded, and in-process
weight updates: parameter addresses, and CUDA graphs captured on them, stay valid.

Every load runs in two phases, so a bad checkpoint or update never leaves a mix of old and new weights:

1. plan: read the safetensors headers of every file (names, shapes, dtypes, byte ranges; no data) and
   run each tensor's weight loader on meta tensors (`recording_copies`): every name, shape and dtype is
   checked, and the plan says which checkpoint bytes go to which parameter elements (fused q/k/v and
   gate/up shards, tied embeddings, this tensor-parallel rank's slices). Nothing is written.
2. write: `staging.copy_planned` streams the planned byte ranges through reused host staging
   buffers (pinned on CUDA) with parallel reads overlapped with asynchronous copies; then a batched
   device-side `isfinite` check. A failure here raises with `weights_written` set: the caller must treat
   the weights as invalid until a complete reload or update (see ModelRunner.weights_valid).

Every problem of a checkpoint raises `CheckpointError` naming the file (relative to the checkpoint
folder) and the problem; the safetensors library's own errors never escape.
"""


from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from torpor.engine.models.layers.loading import default_weight_loader, recording_copies
from torpor.engine.phase_times import phase
from torpor.engine.weights.index import (
    CheckpointError,
    PlannedCopy,
    TensorEntry,
    checkpoint_files,
    read_header,
    read_headers,
)
from torpor.engine.weights.staging import StagingBuffers, copy_planned

logger = logging.getLogger("torpor.engine")


# ---- the plan: every check before a byte is written ------------------------------------------------
_parameters: weakref.WeakKeyDictionary[nn.Module, dict[str, nn.Parameter]] = weakref.WeakKeyDictionary()


def parameters_of(model: nn.Module) -> dict[str, nn.Parameter]:
    """`dict(model.named_parameters())`, built once per model. Walking the module tree costs a few ms for a
    36-layer model, and a trainer's push paid it twice per bucket (plan and copy). A model's parameters are
    registered when it is built and never replaced afterwards: every load copies into them in place, and
    the CUDA graphs and the memory layer rely on their addresses staying put. Do not mutate the dict."""
    params = _parameters.get(model)
    if params is None:
        params = _parameters[model] = dict(model.named_parameters())
    return params


def plan_copies(model: nn.Module, sources: Iterable[tuple[str, torch.Size | Sequence[int], torch.dtype]],
                strict: bool) -> list[PlannedCopy]:
    """Run every source's weight loader on meta tensors: ValueError for an unknown name, a wrong shape or
    dtype, a duplicate, or (with `strict`) a parameter or fused shard that nothing covers. Returns where
    each source's elements go; sources the model ignores (tied head, RoPE buffers) have no copies."""
    return _plan(model, sources, strict, want_copies=True)


def check_sources(model: nn.Module, sources: Iterable[tuple[str, torch.Size | Sequence[int], torch.dtype]],
                  strict: bool) -> None:
    """The checks of `plan_copies` without the plan. The meta dry run of a source depends only on its name,
    shape and dtype and on the model's structure, which never changes (`parameters_of`): a (name, shape,
    dtype) the model accepted once is accepted again without running it (`_plans`), so a trainer pushing in
    buckets pays the dry run once per tensor per engine, not once per push. Duplicates, unknown names and (with
    `strict`) coverage are checked on every call."""
    _plan(model, sources, strict, want_copies=False)


@dataclass(frozen=True)
class _SourcePlan:
    param_name: str
    shard_id: object
    copies: tuple[PlannedCopy, ...]


# (name, shape, dtype) -> (parameter name, shard id, its planned copies), per model: what the meta dry run of that
# source found. It depends only on the source's name, shape and dtype and on the model's fixed structure
# (`parameters_of`), so each runs once per model; a trainer pushing in buckets pays it once per tensor per engine,
# not once per push, and its copies skip the weight loaders.
_plans: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, tuple[int, ...], torch.dtype], _SourcePlan]] = \
    weakref.WeakKeyDictionary()


def _plan(model: nn.Module, sources: Iterable[tuple[str, torch.Size | Sequence[int], torch.dtype]], strict: bool,
          want_copies: bool) -> list[PlannedCopy]:
    is_ignored = getattr(model, "is_ignored_weight", lambda name: False)
    loaded: set[tuple[str, object]] = set()
    seen: set[str] = set()
    copies: list[PlannedCopy] = []
    for name, shape, dtype in sources:
        if name in seen:
            raise ValueError(f"tensor {name!r} is given twice")
        seen.add(name)
        if is_ignored(name):
            continue
        plan = _source_plan(model, name, tuple(int(d) for d in shape), dtype)
        if want_copies:
            copies.extend(plan.copies)
        _mark_loaded(loaded, parameters_of(model), plan.param_name, plan.shard_id)
    if strict:
        _check_complete(model, parameters_of(model), loaded)
    return copies


def _mark_loaded(loaded: set[tuple[str, object]], params: dict[str, nn.Parameter], param_name: str,
                 shard_id: object) -> None:
    """Record that (param_name, shard_id) was written; a whole tensor (shard None) of a parameter with shards (the
    fused experts given as one tensor) covers every shard."""
    shards = getattr(params[param_name], "shard_ids", None) if shard_id is None else None
    if shards is None:
        loaded.add((param_name, shard_id))
    else:
        loaded.update((param_name, s) for s in shards)


def _source_plan(model: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> _SourcePlan:
    """The cached plan of one source (not ignored by the model); ValueError when the model refuses it."""
    key = (name, shape, dtype)
    plans = _plans.setdefault(model, {})
    plan = plans.get(key)
    if plan is None:
        params = parameters_of(model)
        param_name, shard_id = _resolve(model, name)
        if param_name not in params:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")
        param = params[param_name]
        stand_in = torch.empty_like(param, device="meta")
        copies = tuple(PlannedCopy(name, param.data.as_strided(dst.shape, dst.stride(),
                                                               param.storage_offset() + dst.storage_offset()), src)
                       for dst, src in _dry_run(param, stand_in, name, shape, dtype, shard_id))
        plan = plans[key] = _SourcePlan(param_name, shard_id, copies)
    return plan


def copy_checked(model: nn.Module, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Copy an update that `check_update` (or `check_staged`) accepted whole, through each source's cached plan:
    one `copy_` per destination view, no weight loader called (they ran once, on meta tensors). Returns the
    number of (parameter, shard) pairs written, as `load_named_tensors` does."""
    is_ignored = getattr(model, "is_ignored_weight", lambda name: False)
    loaded: set[tuple[str, object]] = set()
    with _a_mix_if_written(loaded), torch.no_grad():  # after the checks, only a device failure
        for name, tensor in named_tensors:
            if is_ignored(name):
                continue
            plan = _source_plan(model, name, tuple(tensor.shape), tensor.dtype)
            if plan.copies and not tensor.is_contiguous():  # the source views assume the checkpoint's layout
                tensor = tensor.contiguous()
            base = tensor.storage_offset()
            for c in plan.copies:
                c.dst.copy_(tensor.as_strided(c.src.shape, c.src.stride(), base + c.src.storage_offset()))
            _mark_loaded(loaded, parameters_of(model), plan.param_name, plan.shard_id)
    return len(loaded)


def read_weight(model: nn.Module, name: str, shape: tuple[int, ...]) -> list:
    """What `model` holds of the checkpoint tensor `name` (of the checkpoint's full `shape`), read back through the
    tensor's cached plan (the inverse of an update's copy): each piece as (its shape, stride and offset in the full
    tensor, its values in float32 on the host). Under tensor parallelism a rank holds its shard's pieces."""
    plan = _source_plan(model, name, shape, torch.float32)
    with torch.no_grad():
        return [(tuple(c.src.shape), tuple(c.src.stride()), c.src.storage_offset(), c.dst.detach().float().cpu())
                for c in plan.copies]


@contextlib.contextmanager
def _a_mix_if_written(loaded: set) -> Iterator[None]:
    """A failure inside, once `loaded` holds what was written, raises CheckpointError with `weights_written` (the
    weights are now a mix); before any write it is raised as it is (the weights are as they were)."""
    try:
        yield
    except Exception as e:
        if not loaded:
            raise
        raise CheckpointError(f"the update failed after writing {len(loaded)} tensors, so the weights are now a "
                              f"mix (complete the update or reload): {e}", weights_written=True) from e


def _dry_run(param: nn.Parameter, stand_in: torch.Tensor, name: str, shape: tuple[int, ...], dtype: torch.dtype,
             shard_id: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (destination, source) meta views `param`'s weight loader would copy; ValueError if it refuses."""
    weight_loader = getattr(param, "weight_loader", default_weight_loader)
    with recording_copies() as recorded:
        try:
            weight_loader(stand_in, torch.empty(shape, dtype=dtype, device="meta"), shard_id)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
    return list(recorded)


def plan_checkpoint(model: nn.Module, path: str | Path) -> tuple[list[TensorEntry], list[PlannedCopy]]:
    """Headers of every file of `path` checked against `model` (strict); CheckpointError names the file."""
    entries = read_headers(path)
    current: list[TensorEntry] = []

    def sources() -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
        for entry in entries:
            current[:] = [entry]
            yield entry.name, entry.shape, entry.dtype
        current.clear()  # past the last tensor: what fails now is the checkpoint as a whole

    try:
        copies = plan_copies(model, sources(), strict=True)
    except ValueError as e:
        raise CheckpointError(f"{current[0].label if current else 'checkpoint'}: {e}") from None
    return entries, copies


# ---- loading ---------------------------------------------------------------------------------------
def load_weights(model: nn.Module, path: str | Path, staging=None) -> None:
    """Load every parameter of `model` from the checkpoint folder `path` (the fast, staged path); every
    parameter must be covered and every checkpoint tensor must belong to one. Also recomputes, in place,
    the buffers no checkpoint holds (`model.reset_buffers()`), so this restores a model whose weights were
    discarded. `staging`: reused `staging.StagingBuffers` (default: temporary ones)."""

    start = time.perf_counter()
    with phase("load_plan"):
        entries, copies = plan_checkpoint(model, path)
    planned = time.perf_counter()
    device = next(model.parameters()).device
    own = staging is None
    staging = StagingBuffers(device) if own else staging
    try:
        with phase("load_copy"):
            nbytes = copy_planned(entries, copies, staging)
        copied = time.perf_counter()
        with phase("load_finite_check"):
            check_finite(copies)
        logger.debug("loaded %.3f GB from %s: plan %.3f s, copy %.3f s (%.1f GB/s), finite check %.3f s",
                     nbytes / 1e9, path, planned - start, copied - planned,
                     nbytes / 1e9 / max(copied - planned, 1e-9), time.perf_counter() - copied)
    except CheckpointError:
        raise
    except Exception as e:
        raise load_failed(path, e) from e
    finally:
        if own:
            staging.close()
    if hasattr(model, "reset_buffers"):
        with phase("load_reset_buffers"):
            model.reset_buffers()


def load_failed(path: str | Path, error: BaseException) -> CheckpointError:
    """The error of a load that failed after it began writing (`error` is not a CheckpointError already)."""
    return CheckpointError(f"loading {path} failed after writing weights: {error}", weights_written=True)


def load_weights_reference(model: nn.Module, path: str | Path) -> None:
    """The plain path, one tensor at a time through `safe_open` and `load_named_tensors` (no staging):
    what the staged loader is compared with, bit for bit and in speed. Validates every header first."""
    plan_checkpoint(model, path)
    load_named_tensors(model, iter_checkpoint(path), strict=True)
    if hasattr(model, "reset_buffers"):
        model.reset_buffers()


def first_non_finite(tensors: Sequence[torch.Tensor]) -> int | None:
    """Index of the first tensor holding a NaN or an infinity, else None. One `aminmax` reduction per run of
    tensors (NaN propagates into min and max; ±inf is the min or the max): no bool temporary of the tensor's
    size, 30x faster than `isfinite().all()` on CPU. A run is one tensor, or tensors lying one after the
    other in one storage (a flattened bucket's views: one reduction over the bucket instead of one per
    tensor). The extremes are stacked per device and dtype and read with one synchronization per device;
    a run found non-finite is then checked tensor by tensor (the padding between them may be anything)."""
    groups: dict[torch.device, dict[torch.dtype, tuple[list[list[int]], list[torch.Tensor]]]] = {}
    for members, covering in _runs(tensors):
        runs, extremes = groups.setdefault(covering.device, {}).setdefault(covering.dtype, ([], []))
        runs.append(members)
        extremes.extend(torch.aminmax(covering))
    bad = []
    for by_dtype in groups.values():
        finite = [torch.isfinite(torch.stack(extremes)) for _, extremes in by_dtype.values()]  # [2 x runs] per dtype
        flags = finite[0] if len(finite) == 1 else torch.cat(finite)  # (min, max) of every run, dtype by dtype
        if not bool(flags.all()):  # the one synchronization of the device (all finite: the common case)
            runs = [members for run_list, _ in by_dtype.values() for members in run_list]
            per_run = flags.view(-1, 2).all(dim=1)
            bad += [i for j in (~per_run).nonzero().view(-1).tolist() for i in _non_finite(tensors, runs[int(j)])]
    return min(bad) if bad else None


def _non_finite(tensors: Sequence[torch.Tensor], members: list[int]) -> list[int]:
    """The members of a run found non-finite that are (none: only the padding between them was)."""
    if len(members) == 1:
        return members
    return [i for i in members if first_non_finite([tensors[i]]) is not None]


_MAX_RUN_GAP_BYTES = 64  # a flattened bucket pads each tensor to 16 bytes


def _runs(tensors: Sequence[torch.Tensor]) -> list[tuple[list[int], torch.Tensor]]:
    """(indices, one tensor covering them) for every floating tensor with elements: contiguous tensors of one
    dtype that follow each other in one storage (gaps of a few bytes, aligned to the dtype) share a run."""
    runs: list[tuple[list[int], torch.Tensor]] = []
    by_storage: dict[tuple, list[int]] = {}
    for i, tensor in enumerate(tensors):
        if not (tensor.numel() and tensor.is_floating_point()):
            continue
        if tensor.is_contiguous():
            key = (tensor.device, tensor.dtype, tensor.untyped_storage().data_ptr())
            by_storage.setdefault(key, []).append(i)
        else:
            runs.append(([i], tensor))
    for members in by_storage.values():
        members.sort(key=lambda i: tensors[i].data_ptr())
        first = 0
        for k in range(1, len(members) + 1):
            if k < len(members) and _follows(tensors[members[k - 1]], tensors[members[k]]):
                continue
            run = members[first:k]
            runs.append((run, _covering(tensors[run[0]], tensors[run[-1]])))
            first = k
    return runs


def _follows(prev: torch.Tensor, cur: torch.Tensor) -> bool:
    gap = cur.data_ptr() - (prev.data_ptr() + prev.numel() * prev.element_size())
    return 0 <= gap <= _MAX_RUN_GAP_BYTES and gap % cur.element_size() == 0


def _covering(first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The 1-D view of `first`'s storage from `first`'s first element to `last`'s last one."""
    if first is last:
        return first
    numel = (last.data_ptr() + last.numel() * last.element_size() - first.data_ptr()) // first.element_size()
    return first.as_strided((numel,), (1,), first.storage_offset())


def check_finite(copies: Sequence[PlannedCopy]) -> None:
    """CheckpointError (weights_written) naming the first tensor whose destination holds a NaN or an
    infinity (see `first_non_finite`)."""
    bad = first_non_finite([c.dst for c in copies])
    if bad is not None:
        raise CheckpointError(f"tensor {copies[bad].name!r} holds non-finite values (NaN or infinity)",
                              weights_written=True)


def check_update(model: nn.Module, named_tensors: Sequence[tuple[str, torch.Tensor]], strict: bool,
                 staged: bool = False) -> None:
    """Validate a whole update before any of it is written: names, shapes, dtypes and finite values
    (ValueError naming the tensor). `staged`: `check_staged` passed these very tensors already (a push
    checked off the engine thread), so only the coverage is checked here, with `strict` (it needs the plan)."""
    for item in named_tensors:
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise ValueError("update_weights takes (name, tensor) pairs")
    if strict or not staged:
        with phase("plan"):
            check_sources(model, ((n, t.shape, t.dtype) for n, t in named_tensors), strict)
    if not staged:
        check_values(named_tensors)


def check_staged(model: nn.Module, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """What `check_update` checks of a partial update (names, shapes, dtypes, finite values), on any thread: it
    reads the model's fixed structure and the tensors only. The values must not change until the copy (a
    trainer keeps its buckets as they are until the engine answered)."""
    with phase("plan"):
        check_sources(model, ((n, t.shape, t.dtype) for n, t in named_tensors), strict=False)
    check_values(named_tensors)


def check_values(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    with phase("finite"):
        bad = first_non_finite([t for _, t in named_tensors])
    if bad is not None:
        raise ValueError(f"tensor {named_tensors[bad][0]!r} holds non-finite values (NaN or infinity)")


def load_named_tensors(
    model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = False,
    values_checked: bool = False,
) -> int:
    """Copy tensors named as in the Hugging Face checkpoint (e.g. `model.layers.0.self_attn.q_proj.weight`)
    into `model`, one at a time as they come (a stream: each is checked, names, shape, dtype and finite
    values, before it is written, but earlier ones are already written when a later one fails). With
    `strict`, raise if any parameter (or fused shard) received nothing. Returns the number of tensors
    loaded. Buffers are not touched: after discarding the weights, call `model.reset_buffers()` once.
    `values_checked`: `check_update` (or `check_staged`) accepted the list whole — names, shapes, dtypes, finite
    values and, with `strict`, the coverage — so it is copied through the cached plans (`copy_checked`), without
    the per-tensor checks (a device synchronization each, ~400 for an 8B model) or the weight loaders."""
    if values_checked:
        return copy_checked(model, named_tensors)
    params = parameters_of(model)
    is_ignored = getattr(model, "is_ignored_weight", lambda name: False)
    loaded: set[tuple[str, object]] = set()
    with _a_mix_if_written(loaded):
        _load_each(model, params, named_tensors, is_ignored, loaded, strict)
    return len(loaded)


def _load_each(model: nn.Module, params: dict[str, nn.Parameter], named_tensors: Iterable, is_ignored,
               loaded: set[tuple[str, object]], strict: bool) -> None:
    with torch.no_grad():
        for name, tensor in named_tensors:
            if is_ignored(name):
                continue
            param_name, shard_id = _resolve(model, name)
            if param_name not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
            if first_non_finite([tensor]) is not None:
                raise ValueError(f"tensor {name!r} holds non-finite values (NaN or infinity)")
            param = params[param_name]
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                weight_loader(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
            _mark_loaded(loaded, params, param_name, shard_id)
    if strict:
        _check_complete(model, params, loaded)


def _check_complete(model: nn.Module, params: dict, loaded: set) -> None:
    """ValueError naming the checkpoint tensors (Hugging Face names) that no loaded shard covered."""
    expected = {(n, s) for n, p in params.items() for s in getattr(p, "shard_ids", (None,))}
    missing = sorted(_hf_name(model, n, s) for n, s in expected - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")


def iter_checkpoint(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the checkpoint, one at a time (never all in memory).
    Every header is checked first; a file the safetensors library still rejects raises CheckpointError."""
    from safetensors import SafetensorError, safe_open  # the plain path's only: the staged one reads the files itself

    root = Path(path)
    for file in checkpoint_files(root):
        label = file.relative_to(root).as_posix()
        read_header(file, label)
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"{label}: {e}") from None


def _resolve(model: nn.Module, name: str) -> tuple[str, object]:
    """Checkpoint name -> (parameter name, shard id); e.g. q_proj -> (qkv_proj, "q"): the model's own
    `resolve_weight_name` where it has one (the fused experts), else its `packed_modules_mapping`."""
    resolve = getattr(model, "resolve_weight_name", None)
    if resolve is not None:
        return resolve(name)
    for module, (fused, shard_id) in getattr(model, "packed_modules_mapping", {}).items():
        if f".{module}." in name:
            return name.replace(f".{module}.", f".{fused}."), shard_id
    return name, None


def _hf_name(model: nn.Module, param_name: str, shard_id: object) -> str:
    """The checkpoint name of a parameter's shard (the inverse of `_resolve`)."""
    name_of = getattr(model, "checkpoint_name", None)
    if name_of is not None:
        return name_of(param_name, shard_id)
    for module, (fused, shard) in getattr(model, "packed_modules_mapping", {}).items():
        if shard == shard_id and f".{fused}." in param_name:
            return param_name.replace(f".{fused}.", f".{module}.")
    return param_name
