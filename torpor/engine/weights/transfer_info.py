"""vLLM's native weight transfer, what travels: the `init_info` and `update_info` of each backend, parsed and checked
in vLLM's field names (an unknown field, a missing one, a wrong type is a ValueError naming it), and a rank's side of
an IPC update: the trainer's tensors opened by reference (CUDA IPC handles for this rank's GPU, shared-memory files
on CPU) and checked against what the update declares. Touches no engine state.

The IPC handles: one entry per tensor, `{device key: handle}`, or one entry for a packed buffer, `{device key:
handle}` with `tensor_sizes` (the bytes of each tensor, in order, from the buffer's start). The device key is the
GPU's UUID (`str(torch.cuda.get_device_properties(i).uuid)`, what vLLM's trainers send) or "cpu" for an engine on CPU.
A handle is `torch.multiprocessing.reductions.reduce_tensor`'s arguments (vLLM's newest form) or its (rebuild
function, arguments) pair (vLLM's earlier one, OpenRLHF's). Over HTTP the list travels as `ipc_handles_pickled`,
base64 of a pickle: vLLM unpickles it with `pickle.loads` and so refuses it unless
`VLLM_ALLOW_INSECURE_SERIALIZATION=1`; torpor reads it with its restricted unpickler (payload.py: tensor rebuild
functions, dtypes and plain containers only, every IPC range and shared-memory file checked), so it needs no such
switch. On CPU the handles must be pickled with `torch.multiprocessing`'s `ForkingPickler` (shared-memory files: a
plain pickle carries a CPU tensor's bytes, which is refused); `torpor.rl.vllm_transfer` does it.
"""

from __future__ import annotations

import base64
import binascii
import math
import reprlib
from dataclasses import MISSING, dataclass, fields
from typing import Any

import torch

from torpor.engine.weights.payload import MAX_SERIALIZED_CHARS, RestrictedUnpickler, is_int, parse_dtype
from torpor.engine.weights.transport import DEFAULT_GROUP_TIMEOUT_S, MAX_GROUP_TIMEOUT_S

TRANSFER_GROUP = "vllm_weight_transfer"  # the nccl backend's update group (the engine's and its trainer's)
DEFAULT_PACKED_BUFFER_BYTES = 1 << 30  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES
DEFAULT_PACKED_NUM_BUFFERS = 2
MAX_TENSORS = 100_000


# ---- the infos -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NCCLInitInfo:
    """vLLM's NCCL init_info: the trainer (rank 0) hosts the group at master_address:master_port; engine rank r
    joins as `rank_offset + r` of `world_size`. `packed*`: the default of each update (vLLM's newer init info
    carries them). `timeout` (torpor's): seconds for the group to form and for each update's broadcasts."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    timeout: float = DEFAULT_GROUP_TIMEOUT_S

    def __post_init__(self) -> None:
        _check_types(self, {"master_address": str, "master_port": int, "rank_offset": int, "world_size": int,
                            "packed": bool, "packed_buffer_size_bytes": int, "packed_num_buffers": int,
                            "timeout": float}, "init_info")
        _check_packing(self.packed_buffer_size_bytes, self.packed_num_buffers, "init_info")
        if not 0 < self.timeout <= MAX_GROUP_TIMEOUT_S:
            raise ValueError(f"init_info.timeout must be in (0, {MAX_GROUP_TIMEOUT_S:g}] seconds, got {self.timeout}")


@dataclass(frozen=True)
class NCCLUpdateInfo:
    """vLLM's NCCL update_info: the trainer broadcasts each tensor from rank 0 in `names` order (or, `packed`,
    uint8 buffers of consecutive tensors, each closed once it holds more than `packed_buffer_size_bytes`)."""

    names: list
    dtype_names: list
    shapes: list
    packed: bool | None = None  # None: the init_info's
    packed_buffer_size_bytes: int | None = None
    packed_num_buffers: int | None = None  # how many buffers the trainer overlaps: the bytes on the wire are the same

    def __post_init__(self) -> None:
        _check_types(self, {"packed": (bool, type(None)), "packed_buffer_size_bytes": (int, type(None)),
                            "packed_num_buffers": (int, type(None))}, "update_info")
        _check_packing(self.packed_buffer_size_bytes or 1, self.packed_num_buffers or 1, "update_info")
        _specs(self.names, self.dtype_names, self.shapes)


@dataclass(frozen=True)
class IPCUpdateInfo:
    """vLLM's IPC update_info: `ipc_handles` (Python) or `ipc_handles_pickled` (HTTP), exactly one; `tensor_sizes`
    for a packed buffer (then `ipc_handles` is one handle dict). `packed` (older vLLM): said instead of implied."""

    names: list
    dtype_names: list
    shapes: list
    ipc_handles: Any = None
    ipc_handles_pickled: str | None = None
    tensor_sizes: list | None = None
    packed: bool | None = None

    def __post_init__(self) -> None:
        if (self.ipc_handles is None) == (self.ipc_handles_pickled is None):
            raise ValueError("update_info: give exactly one of ipc_handles and ipc_handles_pickled")
        _check_types(self, {"ipc_handles_pickled": (str, type(None)), "packed": (bool, type(None))}, "update_info")
        specs = _specs(self.names, self.dtype_names, self.shapes)
        if self.is_packed:
            sizes = self.tensor_sizes
            if not isinstance(sizes, list) or len(sizes) != len(specs) or not all(is_int(n) for n in sizes):
                raise ValueError("update_info.tensor_sizes must list each tensor's bytes in the packed buffer")
            for (name, dtype, shape), size in zip(specs, sizes, strict=True):
                if size != math.prod(shape) * dtype.itemsize:
                    raise ValueError(f"update_info.tensor_sizes: {name!r} is {size} bytes, its {dtype} {list(shape)} "
                                     f"holds {math.prod(shape) * dtype.itemsize}")
        elif self.tensor_sizes is not None:
            raise ValueError("update_info.tensor_sizes is for a packed buffer (ipc_handles: one handle dict)")

    @property
    def is_packed(self) -> bool:
        return bool(self.packed) or self.tensor_sizes is not None or isinstance(self.ipc_handles, dict)


def parse(cls: type, info: Any, what: str):
    """`cls(**info)` with every field named in the API's words: `info` must be a dict, unknown fields are refused by
    name (vLLM's own parse raises TypeError for them too), missing ones named."""
    if not isinstance(info, dict):
        raise ValueError(f"{what} must be a JSON object of the backend's fields, got {type(info).__name__}")
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(info) - set(names))
    if unknown:
        raise ValueError(f"{what}: unknown field(s) {unknown}; this backend takes {names}")
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    missing = [n for n in required if n not in info]
    if missing:
        raise ValueError(f"{what}: missing field(s) {missing}")
    return cls(**info)


def _check_types(info, types: dict, what: str) -> None:
    for name, kinds in types.items():
        value = getattr(info, name)
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        ok = any(value is None if k is type(None) else isinstance(value, bool) if k is bool else
                 is_int(value) if k is int else (isinstance(value, int | float) and not isinstance(value, bool))
                 if k is float else isinstance(value, k) for k in kinds)
        if not ok:
            names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise ValueError(f"{what}.{name} must be {names}, got {reprlib.repr(value)}")


def _check_packing(buffer_bytes: int, num_buffers: int, what: str) -> None:
    if buffer_bytes < 1:
        raise ValueError(f"{what}.packed_buffer_size_bytes must be >= 1, got {buffer_bytes}")
    if not 1 <= num_buffers <= 64:
        raise ValueError(f"{what}.packed_num_buffers must be in [1, 64], got {num_buffers}")


def _specs(names, dtype_names, shapes) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor; vLLM's own length checks, in its words, plus the types."""
    if not all(isinstance(v, list) for v in (names, dtype_names, shapes)):
        raise ValueError("update_info.names, dtype_names and shapes must be lists")
    if len(dtype_names) != len(names):
        raise ValueError(f"`dtype_names` should be of the same size as `names`: got {len(dtype_names)} and "
                         f"{len(names)}")
    if len(shapes) != len(names):
        raise ValueError(f"`shapes` should be of the same size as `names`: got {len(shapes)} and {len(names)}")
    if not names or len(names) > MAX_TENSORS:
        raise ValueError(f"update_info.names must list 1 to {MAX_TENSORS} tensors, got {len(names)}")
    specs = []
    for name, dtype, shape in zip(names, dtype_names, shapes, strict=True):
        if not isinstance(name, str) or not name:
            raise ValueError(f"update_info.names must be non-empty strings, got {reprlib.repr(name)}")
        if not isinstance(shape, list | tuple) or not all(is_int(d) and 0 <= d < 1 << 40 for d in shape):
            raise ValueError(f"update_info.shapes of {name!r} must be a list of non-negative ints, got "
                             f"{reprlib.repr(shape)}")
        specs.append((name, parse_dtype(dtype, f"update_info.dtype_names of {name!r}"), tuple(shape)))
    return specs


def specs_of(info: NCCLUpdateInfo | IPCUpdateInfo) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return _specs(info.names, info.dtype_names, info.shapes)


# ---- a rank's side of an IPC update --------------------------------------------------------------------
def device_key(device: torch.device) -> str:
    """The key of this rank's handles: its GPU's UUID, as vLLM's trainers key them, or "cpu"."""
    if device.type != "cuda":
        return "cpu"
    return str(torch.cuda.get_device_properties(device).uuid)


def open_ipc(info: IPCUpdateInfo, device: torch.device, max_bytes: int) -> list[tuple[str, torch.Tensor]]:
    """This rank's tensors of an IPC update: its handles (by `device_key`) opened, each tensor's dtype and shape
    (or, packed, each slice of the buffer) checked against what the update declares. Views of the trainer's memory:
    the caller copies them, then releases them."""
    if info.ipc_handles_pickled is not None:
        handles, unpickler = _unpickle_handles(info.ipc_handles_pickled, max_bytes)
    else:
        handles, unpickler = info.ipc_handles, None
    specs = specs_of(info)
    key = device_key(device)
    if info.is_packed:
        entries = [handles] if isinstance(handles, dict) else handles
        if not isinstance(entries, list) or len(entries) != 1:
            raise ValueError("update_info.ipc_handles of a packed update must be one handle dict (the buffer's)")
        buffer = _open_one(entries[0], key, device, unpickler, "the packed buffer")
        return unpack(buffer, specs)
    if not isinstance(handles, list) or len(handles) != len(specs):
        raise ValueError(f"`ipc_handles` should be of the same size as `names`: got "
                         f"{len(handles) if isinstance(handles, list) else type(handles).__name__} and {len(specs)}")
    pairs = []
    for (name, dtype, shape), entry in zip(specs, handles, strict=True):
        tensor = _open_one(entry, key, device, unpickler, repr(name))
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"update_info declares {name!r} as {dtype} {list(shape)}, its handle holds "
                             f"{tensor.dtype} {list(tensor.shape)}")
        pairs.append((name, tensor))
    return pairs


def _unpickle_handles(pickled: str, max_bytes: int) -> tuple[Any, RestrictedUnpickler]:
    """`ipc_handles_pickled` read by the restricted unpickler (nothing but tensor rebuild functions, dtypes and
    containers; the rebuild functions come back as the unpickler's checked ones, called later with this rank's
    device). Shared-memory storages (CPU) are mapped here."""
    try:
        data = base64.b64decode(pickled, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("update_info.ipc_handles_pickled is not valid base64") from None
    if len(pickled) > MAX_SERIALIZED_CHARS:
        raise ValueError(f"update_info.ipc_handles_pickled has {len(pickled)} characters; at most "
                         f"{MAX_SERIALIZED_CHARS} (handles, not data)")
    unpickler = RestrictedUnpickler(data, max_bytes)
    try:
        return unpickler.load(), unpickler
    except ValueError:  # a refused name or opcode (RefusedPickle), a shared-memory file that cannot be opened
        raise
    except RuntimeError as e:
        raise ValueError(f"could not open the trainer's tensors ({e}); the trainer must keep them alive until the "
                         "engine answers") from None
    except Exception as e:  # UnpicklingError, EOFError, TypeError, IndexError, KeyError, AttributeError, ...
        raise ValueError(f"update_info.ipc_handles_pickled is not a valid pickle of IPC handles: "
                         f"{type(e).__name__}: {e}") from None
    finally:
        unpickler.memo.clear()
        getattr(unpickler, "stack", []).clear()


def _open_one(entry, key: str, device: torch.device, unpickler: RestrictedUnpickler | None,
              what: str) -> torch.Tensor:
    """One `{device key: handle}` entry opened on `device`."""
    if not isinstance(entry, dict):
        raise ValueError(f"the IPC handle of {what} must be a dict of device keys, got {type(entry).__name__}")
    if key not in entry:
        raise ValueError(f"IPC handle not found for {'GPU UUID ' if key != 'cpu' else 'device '}{key} ({what}). "
                         f"Available keys: {sorted(map(str, entry))[:8]}")
    function, args = _function_and_args(entry[key], unpickler, what, device)
    args = list(args)
    if device.type == "cuda":
        if len(args) != 15:
            raise ValueError(f"the CUDA IPC handle of {what} must hold reduce_tensor's 15 arguments")
        args[6] = device.index if device.index is not None else torch.cuda.current_device()  # this rank's GPU
    tensor = function(*args)
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"the IPC handle of {what} did not rebuild a tensor")
    if tensor.device.type != device.type:
        raise ValueError(f"the IPC handle of {what} holds a {tensor.device.type} tensor; this engine runs on "
                         f"{device.type}")
    return tensor


def _function_and_args(handle, unpickler: RestrictedUnpickler | None, what: str, device: torch.device):
    """(rebuild function, arguments) of a handle given either way. Over HTTP only the restricted unpickler's own
    (checked) rebuild functions are called; from Python (the caller's own objects, as vLLM's Ray path passes them)
    torch's."""
    from torch.multiprocessing import reductions

    cuda = device.type == "cuda"  # arguments alone: rebuild_cuda_tensor's (15) on CUDA, rebuild_tensor's (3) on CPU
    if unpickler is not None:
        allowed = {(unpickler, RestrictedUnpickler._rebuild_cuda_tensor),
                   (unpickler, RestrictedUnpickler._rebuild_tensor)}
        default = unpickler._rebuild_cuda_tensor if cuda else unpickler._rebuild_tensor
    else:
        allowed = {(None, reductions.rebuild_cuda_tensor), (None, reductions.rebuild_tensor)}
        default = reductions.rebuild_cuda_tensor if cuda else reductions.rebuild_tensor

    def is_allowed(function) -> bool:
        bound_to = getattr(function, "__self__", None)
        return (bound_to, getattr(function, "__func__", function)) in allowed
    if isinstance(handle, tuple | list) and len(handle) == 2 and callable(handle[0]):
        function, args = handle
        if not is_allowed(function):
            raise ValueError(f"the IPC handle of {what} names {getattr(function, '__name__', function)!r}; only "
                             "torch.multiprocessing's rebuild_cuda_tensor / rebuild_tensor are called")
    else:
        function, args = default, handle
    if not isinstance(args, tuple | list):
        raise ValueError(f"the IPC handle of {what} must be reduce_tensor's arguments (a tuple)")
    return function, args


def unpack(buffer: torch.Tensor, specs) -> list[tuple[str, torch.Tensor]]:
    """vLLM's unpack_tensor: consecutive slices of a 1-D uint8 buffer from its start, each viewed as its tensor
    (a slice not aligned to its dtype is copied first)."""
    sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in specs]
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"a packed buffer must be a 1-D uint8 tensor, got {buffer.dtype} {list(buffer.shape)}")
    if sum(sizes) > buffer.numel():
        raise ValueError(f"the packed tensors need {sum(sizes)} bytes; the buffer holds {buffer.numel()}")
    pairs, offset = [], 0
    for (name, dtype, shape), size in zip(specs, sizes, strict=True):
        piece = buffer.narrow(0, offset, size)
        if piece.storage_offset() % dtype.itemsize:
            piece = piece.clone()
        pairs.append((name, piece.view(dtype).view(shape)))
        offset += size
    return pairs


def packed_groups(specs, buffer_bytes: int) -> list[list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    """vLLM's packing of a broadcast: consecutive tensors, a buffer closed once it holds more than `buffer_bytes`
    (the tensor that crosses the bound included), the rest in the last buffer."""
    groups, current, size = [], [], 0
    for spec in specs:
        current.append(spec)
        size += math.prod(spec[2]) * spec[1].itemsize
        if size > buffer_bytes:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups
