"""Weights pushed into a running engine by a trainer in another process (SGLang's contract).

Two transports, one validation and one copy path:

- **Tensors by reference** (`update_weights_from_tensor`): the trainer pickles `[(name, tensor), ...]`, or a
  flattened bucket `{"flattened_tensor": t, "metadata": [(name, shape, dtype, start, end), ...]}`, with
  `torch.multiprocessing`'s ForkingPickler and sends it base64-encoded. CUDA tensors travel as CUDA IPC
  handles (the engine maps the trainer's memory and copies from it), CPU tensors as shared-memory files
  (the trainer sets the `file_system` sharing strategy). Unpickling a request body would be code execution:
  `RestrictedUnpickler` admits only torch's tensor and storage rebuild functions, dtypes, `torch.Size`,
  `torch.device` and plain containers, checks every shared-memory name and size before mapping it, and
  refuses everything else (`RefusedPickle`, a ValueError: HTTP 400) without calling it; every tensor view must
  lie inside its storage.
- **A process group** (`init_weights_update_group` / `update_weights_from_distributed`): the trainer's rank 0
  broadcasts each tensor, in order; NCCL on GPU, gloo on CPU. The group is standalone: a `TCPStore` at the
  trainer's address, a `PrefixStore` per group name and a `ProcessGroupGloo` / `ProcessGroupNCCL` built on
  it directly. It is never the default group and never goes through `new_group`, so the engine's own
  tensor-parallel group (the default group) is untouched, and destroying it is dropping the object.
  Before the backend is built every rank checks in on the store (`_rendezvous`) with a deadline, so a group
  that never forms is a clear `WeightTransferError` and nothing was created.

Both transports end in `apply_named_tensors`: the weights tag must be awake, every name / shape / dtype of
the bucket is checked against the checkpoint's manifest before a byte is written, then the bucket goes
through the engine's own `update_weights` path (fused q/k/v and gate/up handled there). After a level-2
sleep the weights are complete only once every checkpoint tensor arrived (possibly over many buckets);
until then the engine does not serve. References to the trainer's memory are dropped right after the copy
(`torch.cuda.ipc_collect()` releases the IPC mappings).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import io
import os
import pickle
import re
import reprlib
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import ClassVar, NoReturn

import torch

from torpor.engine import phase_times
from torpor.engine.models.layers.loading import LOADABLE_DTYPES
from torpor.engine.phase_times import phase

MAX_SERIALIZED_CHARS = 64 << 20  # one rank's base64 payload (handles, not data: an 8B model is ~15 KB)
MAX_TENSORS_PER_PAYLOAD = 100_000
DEFAULT_GROUP_TIMEOUT_S = 120.0

_DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float16", "bfloat16", "float64", "uint8", "int8", "int16", "int32", "int64", "bool")}


class RefusedPickle(ValueError):
    """A payload that names anything but tensors, storages and plain containers (it is never called)."""


class WeightTransferError(RuntimeError):
    """A weight transfer that could not happen (group never formed, trainer gone); nothing was written."""


# ---- the restricted unpickler --------------------------------------------------------------------------
class _Class:
    """A class the payload may name only as an argument of a rebuild function (never call it: a pickle
    could REDUCE `torch.Tensor(10**12)` otherwise)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name

    def __call__(self, *args, **kwargs):
        raise RefusedPickle(f"refused to call {self.name} (a payload may name it only as a tensor's class)")


class SGLangBucketMetadata:
    """Stands in for SGLang's `FlattenedTensorMetadata` dataclass (what its trainers pickle into flattened
    buckets): built empty by NEWOBJ, its fields set by BUILD, nothing else allowed."""

    FIELDS = frozenset({"name", "shape", "dtype", "start_idx", "end_idx", "numel"})


_SGLANG_METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
_TENSOR, _PARAMETER = _Class("torch.Tensor"), _Class("torch.nn.Parameter")
_UNTYPED, _TYPED = _Class("torch.storage.UntypedStorage"), _Class("torch.storage.TypedStorage")
_SHM_HANDLE = re.compile(r"/torch_\d+_\d+_\d+")
_SHM_MANAGER = re.compile(r".*/torch-shm-dir-\w+/manager\.sock")


class RestrictedUnpickler(pickle._Unpickler):
    """`pickle.Unpickler` that resolves only the names `torch.multiprocessing` pickles of tensors use.

    The pure-Python unpickler, so the opcodes that build arbitrary objects (BUILD, INST, OBJ, NEWOBJ,
    persistent ids, extension codes) can be refused too. `max_bytes` bounds the shared memory and CUDA
    memory the payload may map in total."""

    dispatch: ClassVar[dict] = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes, max_bytes: int) -> None:
        super().__init__(io.BytesIO(data))
        self.max_bytes, self.mapped_bytes = max_bytes, 0
        self.tensors = 0
        self._table: dict | None = None

    def find_class(self, module: str, name: str):
        if self._table is None:  # built once per payload, not per GLOBAL opcode
            self._table = self._allowed()
        allowed = self._table.get((module, name))
        if allowed is None:
            raise RefusedPickle(f"refused to unpickle {module}.{name}: a weight payload may hold only tensors "
                                "(torch.multiprocessing rebuild functions), dtypes and plain containers")
        return allowed

    def _allowed(self) -> dict:
        reductions = "torch.multiprocessing.reductions"
        return {
            (reductions, "rebuild_tensor"): self._rebuild_tensor,
            (reductions, "rebuild_cuda_tensor"): self._rebuild_cuda_tensor,
            (reductions, "rebuild_storage_filename"): self._rebuild_storage_filename,
            (reductions, "rebuild_storage_empty"): lambda cls: torch.UntypedStorage(),
            (reductions, "rebuild_typed_storage"): self._rebuild_typed_storage,
            ("torch", "Tensor"): _TENSOR, ("torch.nn.parameter", "Parameter"): _PARAMETER,
            ("torch.storage", "UntypedStorage"): _UNTYPED, ("torch.storage", "TypedStorage"): _TYPED,
            ("torch", "Size"): _size, ("torch", "device"): _device, ("collections", "OrderedDict"): _ordered_dict,
            _SGLANG_METADATA: SGLangBucketMetadata,
            **{("torch", name): dtype for name, dtype in _DTYPES.items()},
        }

    def _refuse_opcode(self, *_) -> None:
        raise RefusedPickle("refused to unpickle an object-building opcode (BUILD/INST/OBJ/NEWOBJ/persistent id)")

    for _op in (pickle.INST, pickle.OBJ, pickle.NEWOBJ_EX, pickle.PERSID, pickle.BINPERSID, pickle.EXT1,
                pickle.EXT2, pickle.EXT4):
        dispatch[_op[0]] = _refuse_opcode
    del _op

    def _refuse_set(self, *_) -> None:
        raise RefusedPickle("refused to unpickle a set (a weight payload holds none; hashing its items could "
                            "overflow the C stack)")

    for _op in (pickle.EMPTY_SET, pickle.ADDITEMS, pickle.FROZENSET):
        dispatch[_op[0]] = _refuse_set
    del _op

    def _load_append(self) -> None:
        value = self.stack.pop()
        _extend(self.stack[-1], [value])

    def _load_appends(self) -> None:
        items = self.pop_mark()
        _extend(self.stack[-1], items)

    def _load_dict(self) -> None:
        items = self.pop_mark()
        self.append(_set_items({}, items))

    def _load_setitem(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        _set_items(self.stack[-1], [key, value])

    def _load_setitems(self) -> None:
        items = self.pop_mark()
        _set_items(self.stack[-1], items)

    dispatch[pickle.APPEND[0]] = _load_append
    dispatch[pickle.APPENDS[0]] = _load_appends
    dispatch[pickle.DICT[0]] = _load_dict
    dispatch[pickle.SETITEM[0]] = _load_setitem
    dispatch[pickle.SETITEMS[0]] = _load_setitems

    def _load_newobj(self) -> None:
        """NEWOBJ only for SGLang's bucket metadata (a dataclass pickles as cls.__new__(cls) + BUILD)."""
        args = self.stack.pop()
        cls = self.stack.pop()
        if cls is not SGLangBucketMetadata or args != ():
            self._refuse_opcode()
        self.append(SGLangBucketMetadata())

    def _load_build(self) -> None:
        """BUILD only to fill SGLang's bucket metadata with its own fields."""
        state = self.stack.pop()
        target = self.stack[-1]
        if not isinstance(target, SGLangBucketMetadata) or not isinstance(state, dict) \
                or not set(state) <= SGLangBucketMetadata.FIELDS:
            self._refuse_opcode()
        target.__dict__.update(state)

    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.BUILD[0]] = _load_build

    def _count(self, nbytes: int) -> None:
        self.mapped_bytes += nbytes
        if self.mapped_bytes > self.max_bytes:
            raise RefusedPickle(f"the payload maps more than {self.max_bytes} bytes (twice the model in fp32)")

    def _rebuild_storage_filename(self, cls, manager, handle, size, dtype=None):
        from torch.multiprocessing.reductions import rebuild_storage_filename

        manager, handle = _text(manager), _text(handle)
        if cls not in (_UNTYPED, _TYPED) or not _is_int(size) or size < 0 or \
                (dtype is not None and not isinstance(dtype, torch.dtype)):
            raise RefusedPickle("a shared-memory storage with malformed arguments")
        if handle is None or not _SHM_HANDLE.fullmatch(handle):
            raise RefusedPickle(f"shared-memory name {reprlib.repr(handle)} is not a torch shared-memory file")
        if manager is None or not _SHM_MANAGER.fullmatch(manager) or not _is_socket(manager):
            raise RefusedPickle(f"{reprlib.repr(manager)} is not a torch_shm_manager socket")
        nbytes = size * (torch._utils._element_size(dtype) if dtype is not None else 1)
        shm = Path("/dev/shm") / handle.lstrip("/")
        try:
            available = shm.stat().st_size
        except OSError:
            raise ValueError(f"shared-memory file {handle} does not exist (the trainer freed it, or died)") from None
        if nbytes > available:  # mapping past its end would crash this process (SIGBUS) on first touch
            raise RefusedPickle(f"shared-memory file {handle} holds {available} bytes, the payload claims {nbytes}")
        self._count(nbytes)
        real_cls = torch.TypedStorage if cls is _TYPED else torch.UntypedStorage
        with phase("open"):  # inside "decode": the shared-memory file mapped
            return rebuild_storage_filename(real_cls, manager.encode(), handle.encode(), size, dtype)

    def _rebuild_typed_storage(self, storage, dtype):
        if not isinstance(storage, torch.UntypedStorage) or not isinstance(dtype, torch.dtype):
            raise RefusedPickle("a typed storage with malformed arguments")
        return torch.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

    def _rebuild_tensor(self, cls, storage, metadata):
        from torch.multiprocessing.reductions import rebuild_tensor

        if cls not in (_TENSOR, _PARAMETER) or not isinstance(storage, torch.TypedStorage) or \
                not isinstance(metadata, tuple) or len(metadata) != 4:
            raise RefusedPickle("a tensor with malformed arguments")
        offset, size, stride, _ = metadata
        _check_layout(size, stride, offset)
        _check_inside(size, stride, offset, storage.dtype.itemsize, storage._untyped_storage.nbytes())
        self._counted_tensor()
        return rebuild_tensor(torch.Tensor, storage, (offset, size, stride, False))

    def _rebuild_cuda_tensor(self, cls, size, stride, offset, storage_cls, dtype, device, handle, storage_bytes,
                             storage_offset_bytes, requires_grad, ref_handle, ref_offset, event_handle, event_sync):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if cls not in (_TENSOR, _PARAMETER) or storage_cls is not _TYPED or not isinstance(dtype, torch.dtype) \
                or not _is_int(device) or not all(_is_int(v) and v >= 0 for v in
                                                   (storage_bytes, storage_offset_bytes, ref_offset)) \
                or not all(isinstance(h, bytes) for h in (handle, ref_handle)) \
                or not isinstance(event_handle, bytes | type(None)):
            raise RefusedPickle("a CUDA tensor with malformed arguments")
        _check_layout(size, stride, offset)
        _check_inside(size, stride, offset, dtype.itemsize, storage_bytes)
        if not torch.cuda.is_available():
            raise ValueError("the payload holds CUDA tensors (IPC handles) but this engine has no CUDA device; "
                             "on CPU send tensors in shared memory (sharing strategy 'file_system')")
        self._count(storage_bytes)
        self._counted_tensor()
        with phase("open"):  # inside "decode": the IPC handle opened (and the trainer's event waited for)
            tensor = rebuild_cuda_tensor(torch.Tensor, size, stride, offset, torch.TypedStorage, dtype, device,
                                         handle, storage_bytes, storage_offset_bytes, False, ref_handle, ref_offset,
                                         event_handle, bool(event_sync))
        with phase("range"):  # inside "decode"
            _check_cuda_range(tensor, storage_bytes, storage_offset_bytes)
        return tensor

    def _counted_tensor(self) -> None:
        self.tensors += 1
        if self.tensors > MAX_TENSORS_PER_PAYLOAD:
            raise RefusedPickle(f"the payload holds more than {MAX_TENSORS_PER_PAYLOAD} tensors")


_KEY_TYPES = (str, int)


def _extend(target, items: list) -> None:
    """APPEND(S) only onto a list (the plain unpickler calls `.append` / `.extend` of whatever it finds)."""
    if type(target) is not list:
        raise RefusedPickle(f"refused to append to a {type(target).__name__} (only to a list)")
    target.extend(items)


def _set_items(target, items: list) -> dict:
    """SETITEM(S) / DICT only into a dict, with str or int keys (`tensor[None] = x` would write through a
    tensor; hashing a deeply nested tuple key overflows the C stack)."""
    if type(target) not in (dict, OrderedDict):
        raise RefusedPickle(f"refused to set items of a {type(target).__name__} (only of a dict)")
    keys = items[::2]
    if len(items) % 2 or not all(type(key) in _KEY_TYPES for key in keys):
        raise RefusedPickle("refused a dict whose keys are not strings or ints")
    target.update(zip(keys, items[1::2], strict=True))
    return target


def _size(dims) -> torch.Size:
    """`torch.Size` of a tuple of ints only (torch.Size(tensor) would iterate a mapped tensor)."""
    if not isinstance(dims, tuple | list) or not all(_is_int(d) for d in dims):
        raise RefusedPickle("torch.Size takes a tuple of ints")
    return torch.Size(dims)


def _device(kind, index=None) -> torch.device:
    """`torch.device` of a type name and an optional index only."""
    if not isinstance(kind, str) or not (index is None or _is_int(index)):
        raise RefusedPickle("torch.device takes a device type and an index")
    return torch.device(kind) if index is None else torch.device(kind, index)


def _ordered_dict(*args) -> OrderedDict:
    """An empty `OrderedDict` (a pickle fills it with SETITEMS; OrderedDict(x) would iterate any x)."""
    if args:
        raise RefusedPickle("OrderedDict is rebuilt empty, then filled")
    return OrderedDict()


def _text(value) -> str | None:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def _check_layout(size, stride, offset) -> None:
    ok = isinstance(size, tuple) and isinstance(stride, tuple) and len(size) == len(stride) <= 8 and \
        all(_is_int(v) and 0 <= v < 1 << 63 for v in (*size, *stride, offset))
    if not ok:
        raise RefusedPickle("a tensor with a malformed size, stride or offset")


def _check_inside(size: tuple, stride: tuple, offset: int, itemsize: int, nbytes: int) -> None:
    """The view (size, stride, offset in elements) must lie inside its storage's `nbytes`: torch's `set_`
    would grow a resizable storage (fresh uninitialized memory, past the payload's budget) instead."""
    if 0 in size:
        return
    end = offset + 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if end * itemsize > nbytes:
        raise RefusedPickle(f"a tensor view reaches {end * itemsize} bytes into a storage of {nbytes} bytes")


def _check_cuda_range(tensor: torch.Tensor, storage_bytes: int, storage_offset_bytes: int) -> None:
    """The storage the payload claims, [mapping + storage_offset_bytes, ... + storage_bytes), must lie inside the
    allocation the IPC handle mapped (else reads run off it, into whatever this process has next to it). Fails
    closed: what the driver cannot vouch for is refused."""
    if storage_bytes == 0:
        return
    try:
        from cuda.bindings import driver
    except ImportError:
        raise RefusedPickle("CUDA IPC payloads need cuda-bindings (pip install torpor[cu12] or torpor[cu13]) to "
                            "check their ranges") from None
    ptr = tensor.untyped_storage().data_ptr()
    err, base, size = driver.cuMemGetAddressRange(ptr - storage_offset_bytes)  # the mapping's own allocation
    if err != driver.CUresult.CUDA_SUCCESS or ptr + storage_bytes > int(base) + int(size):
        raise RefusedPickle(f"the CUDA IPC allocation does not hold the {storage_bytes} bytes at offset "
                            f"{storage_offset_bytes} the payload claims")


def unpickle_payload(serialized: str, max_bytes: int):
    """One rank's base64 ForkingPickler payload -> its object (tensors mapped, nothing else admitted)."""
    if not isinstance(serialized, str) or not serialized:
        raise ValueError("each serialized_named_tensors entry must be a non-empty base64 string")
    if len(serialized) > MAX_SERIALIZED_CHARS:
        raise ValueError(f"a serialized_named_tensors entry has {len(serialized)} characters; at most "
                         f"{MAX_SERIALIZED_CHARS} (send tensors by handle in buckets, not their data)")
    try:
        data = base64.b64decode(serialized, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("a serialized_named_tensors entry is not valid base64") from None
    unpickler = RestrictedUnpickler(data, max_bytes)
    try:
        return unpickler.load()
    except RefusedPickle:
        raise
    except ValueError:
        raise
    except RuntimeError as e:  # torch could not map a tensor (an IPC handle or a file of a process now gone)
        raise ValueError(f"could not open the payload's tensors ({e}); the trainer may have freed them or died, "
                         "and must keep them alive until the engine answers") from None
    except (pickle.UnpicklingError, EOFError, TypeError, IndexError, KeyError, AttributeError,
            OverflowError) as e:
        raise ValueError(f"a serialized_named_tensors entry is not a valid tensor pickle: {type(e).__name__}: "
                         f"{e}") from None
    finally:
        unpickler.memo.clear()  # no reference to the trainer's memory may outlive the copy
        getattr(unpickler, "stack", []).clear()


# ---- payload shapes ----------------------------------------------------------------------------------
def named_tensors_of(payload, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """A decoded payload -> `[(name, tensor), ...]`: a list of pairs (load_format None), or a flattened
    bucket {"flattened_tensor": 1-D tensor, "metadata": [(name, shape, dtype, start, end), ...]} whose
    start / end count elements of the flattened tensor (bytes for a uint8 bucket of mixed dtypes), or
    (torpor's extension) a list of such buckets: a whole model in one request."""
    if load_format is None:
        if isinstance(payload, dict):
            raise ValueError("the payload is a flattened bucket (a dict): send load_format 'flattened_bucket'")
        if not isinstance(payload, list | tuple):
            raise ValueError(f"the payload must be a list of (name, tensor) pairs, got {type(payload).__name__}")
        _check_count(len(payload))
        pairs = []
        for i, item in enumerate(payload):
            if not isinstance(item, list | tuple) or len(item) != 2 or not isinstance(item[0], str) \
                    or not isinstance(item[1], torch.Tensor):
                raise ValueError(f"payload item {i} is not a (name, tensor) pair")
            pairs.append((item[0], item[1]))
        return pairs
    if load_format != "flattened_bucket":
        raise ValueError(f"load_format must be null or 'flattened_bucket', got {load_format!r}")
    if not isinstance(payload, list | tuple):
        return _unflatten(payload, 0)
    pairs = []  # torpor's extension: several buckets in one payload (one request)
    for bucket in payload:
        pairs += _unflatten(bucket, len(pairs))
    return pairs


def _check_count(count: int) -> None:
    """Memo references make a short pickle name one bucket (or entry) a million times: each entry is a view."""
    if count > MAX_TENSORS_PER_PAYLOAD:
        raise ValueError(f"the payload names {count} tensors or more; at most {MAX_TENSORS_PER_PAYLOAD}")


def _unflatten(bucket, before: int) -> list[tuple[str, torch.Tensor]]:
    """One bucket's (name, view) pairs; `before`: the tensors the payload named in earlier buckets."""
    if not isinstance(bucket, dict) or set(bucket) != {"flattened_tensor", "metadata"}:
        raise ValueError("a flattened bucket must be a dict with exactly 'flattened_tensor' and 'metadata'")
    flat, metadata = bucket["flattened_tensor"], bucket["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("flattened_tensor must be one contiguous 1-D tensor")
    if not isinstance(metadata, list | tuple):
        raise ValueError("metadata must be a list of (name, shape, dtype, start, end)")
    _check_count(before + len(metadata))
    pairs = []
    size, offset, numel_flat = flat.element_size(), flat.storage_offset(), flat.numel()
    typed: dict[torch.dtype, torch.Tensor] = {}  # the bucket's storage viewed as each dtype once
    for i, entry in enumerate(metadata):
        name, shape, dtype, start, end = _metadata_entry(entry, i)
        if not 0 <= start <= end <= numel_flat:
            raise ValueError(f"metadata of {name!r}: [{start}, {end}) is outside the bucket of {numel_flat} elements")
        first_byte = (offset + start) * size  # from the storage's start
        if first_byte % dtype.itemsize:
            raise ValueError(f"metadata of {name!r}: element {start} of the {flat.dtype} bucket is not aligned to "
                             f"{dtype} ({dtype.itemsize} bytes)")
        nbytes = (end - start) * size
        numel = 1
        for d in shape:
            numel *= d
        if nbytes != numel * dtype.itemsize:
            raise ValueError(f"metadata of {name!r}: {end - start} elements of {flat.dtype} hold {nbytes} bytes, "
                             f"shape {list(shape)} of {dtype} needs {numel * dtype.itemsize}")
        base = typed.get(dtype)
        if base is None:
            base = typed[dtype] = _storage_as(flat, dtype)
        # One view op per tensor (slice + view + view was three): the bytes checked above lie inside the bucket.
        pairs.append((name, base.as_strided(shape, _contiguous_strides(shape), first_byte // dtype.itemsize)))
    return pairs


def _storage_as(flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D view of `dtype` elements over the whole storage of `flat`, from its first byte."""
    return torch.empty(0, dtype=dtype, device=flat.device).set_(
        flat.untyped_storage(), 0, (flat.untyped_storage().nbytes() // dtype.itemsize,))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _metadata_entry(entry, index: int) -> tuple[str, tuple[int, ...], torch.dtype, int, int]:
    if isinstance(entry, SGLangBucketMetadata):
        entry = vars(entry)
    if isinstance(entry, dict):
        entry = (entry.get("name"), entry.get("shape"), entry.get("dtype"), entry.get("start", entry.get("start_idx")),
                 entry.get("end", entry.get("end_idx")))
    if not isinstance(entry, list | tuple) or len(entry) not in (5, 6):
        raise ValueError(f"metadata entry {index} must be (name, shape, dtype, start, end)")
    name, shape, dtype, start, end = entry[:5]
    if not isinstance(name, str):
        raise ValueError(f"metadata entry {index}: the name must be a string")
    if not isinstance(shape, list | tuple) or not all(_is_int(d) and 0 <= d < 1 << 63 for d in shape):
        raise ValueError(f"metadata of {name!r}: shape must be a list of non-negative 64-bit ints")
    if not _is_int(start) or not _is_int(end):
        raise ValueError(f"metadata of {name!r}: start and end must be ints")
    return name, tuple(shape), parse_dtype(dtype, f"metadata of {name!r}"), start, end


def parse_dtype(value, what: str) -> torch.dtype:
    """A torch.dtype, or its name ("bfloat16", "torch.bfloat16")."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise ValueError(f"{what}: unknown dtype {reprlib.repr(value)}")


# ---- checks against the engine's checkpoint ---------------------------------------------------------
@dataclass(frozen=True)
class Manifest:
    """The checkpoint's tensors: name -> full (unsharded) shape, and the names the model ignores."""

    shapes: dict[str, tuple[int, ...]]

    @classmethod
    def of_checkpoint(cls, path: str) -> Manifest:
        from safetensors import safe_open

        from torpor.engine.loader import checkpoint_files

        shapes = {}
        for file in checkpoint_files(path):
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        return cls(shapes)

    @functools.cached_property
    def max_bytes(self) -> int:
        """What one payload may map at most: twice the model in fp32 (computed once: the manifest is fixed)."""
        return 8 * sum(_numel(s) for s in self.shapes.values()) + (64 << 20)

    def check(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Every name known, every shape the checkpoint's, every dtype loadable, no name twice; raises
        ValueError listing the problems (nothing has been written yet)."""
        problems, seen = [], set()
        for name, tensor in named_tensors:
            if name in seen:
                problems.append(f"{name!r} given twice")
            seen.add(name)
            if name not in self.shapes:
                problems.append(f"unknown tensor {name!r} (not in the model's checkpoint)")
            elif tuple(tensor.shape) != self.shapes[name]:
                problems.append(f"{name!r} has shape {list(tensor.shape)}, the model's is {list(self.shapes[name])}")
            if tensor.dtype not in LOADABLE_DTYPES:
                problems.append(f"{name!r} has dtype {tensor.dtype} (expected bfloat16, float16 or float32)")
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise ValueError(f"weight update refused, nothing was written: {shown}")


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class WeightReceiver:
    """The weight-push state of one engine: its checkpoint manifest and, after a level-2 sleep, which
    checkpoint tensors are still missing (buckets of one update arrive in several calls)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.manifest = Manifest.of_checkpoint(engine.config.model)
        self.missing: set[str] | None = None  # None: the weights are valid (not discarded)
        # `SleepMode.discards` when `missing` was counted from the whole manifest: another level-2 sleep meanwhile
        # zero-filled what came since, so the count starts over (a counter, not a look at the weights: no device
        # synchronization per request).
        self.discards_counted = 0
        # Held while a payload is opened off the engine thread (`stage`) and while a sleep or wake changes the
        # memory (`held`): no IPC handle is opened during a context checkpoint or restore.
        self.gate = threading.Lock()
        self._staged: list[StagedUpdate] = []  # opened, waiting for their copy (dropped by a sleep)
        # Storages of a trainer's memory kept open through a push whose trainer reuses its buffers (`keeping`),
        # by push id, the most recently used last; a sleep releases them all, as it drops the staged updates.
        self._kept: dict[str, OrderedDict[tuple, torch.UntypedStorage]] = {}
        self._keeping: dict[tuple, torch.UntypedStorage] | None = None  # noted by `_release` inside `keeping`
        self._staged_lock = threading.Lock()
        self._stage_stream = None  # EngineStream of the staging thread (CUDA), made on the first staged request

    def check_weights_awake(self, what: str) -> None:
        memory = self.engine.memory
        if memory is not None and "weights" in memory.tags() and memory.is_sleeping("weights"):
            raise RuntimeError(f"{what}: the weights are asleep; wake them first "
                               "(POST /wake_up?tags=weights, or wake_up(['weights']))")

    def decode(self, serialized: Sequence[str], load_format: str | None) -> list[tuple[str, torch.Tensor]]:
        """One base64 payload (`serialized_named_tensors` of one entry) -> named tensors (`apply` checks them
        against the manifest before anything is written). Rank 0 opens it; under tensor parallelism the
        engine streams the full tensors to the other ranks (one entry per rank goes through
        `_per_rank_update` instead)."""
        tp = self.engine.config.tensor_parallel_size
        if not isinstance(serialized, list | tuple) or len(serialized) not in (1, tp):
            raise ValueError(f"serialized_named_tensors must be a list of 1 or tensor_parallel_size ({tp}) "
                             f"base64 strings, got {_describe(serialized)}")
        with phase("decode"):
            payload = unpickle_payload(serialized[0], self.manifest.max_bytes)
            with phase("views"):  # inside "decode": the bucket's (name, view) pairs, their metadata checked
                pairs = named_tensors_of(payload, load_format)
            del payload
        return pairs

    def apply(self, named_tensors: list[tuple[str, torch.Tensor]], flush_cache: bool = True) -> int:
        """Copy checked tensors into the model through the engine's `update_weights` path. After a level-2
        sleep, the engine serves again once every checkpoint tensor came (over any number of calls)."""
        try:
            with phase("check"):
                self.manifest.check(named_tensors)
            return self._copy(named_tensors, flush_cache, staged=False)
        finally:
            self._release(named_tensors)

    def _copy(self, named_tensors: list[tuple[str, torch.Tensor]], flush_cache: bool, staged: bool) -> int:
        names = [name for name, _ in named_tensors]
        runner = self.engine.model_runner
        if self.discarded:  # part of the set: the engine's own path would want every tensor at once; the
            # RoPE table is recomputed once, when the set is complete (`commit`)
            return self.commit(names, lambda: runner.update_weights(named_tensors, strict=False, reset_buffers=False,
                                                                    staged=staged), flush_cache)
        return self.commit(names, lambda: self.engine.update_weights(named_tensors, staged=staged),
                           flush_cache)

    # ---- a push in flight: opened and checked off the engine thread, copied on it ----------------------
    def stage(self, serialized: Sequence[str], load_format: str | None) -> StagedUpdate:
        """Any thread but the engine's (TP=1): open one request's payload and check it — the weights awake, every
        name / shape / dtype against the manifest and the model (the meta dry run), the finite values — while the
        engine thread copies the previous one; `apply_staged` then copies it on the engine thread. CUDA tensors
        are opened on this thread's current stream (the trainer's IPC event is waited for there, and the finite
        check runs there): the staged update carries an event recorded after them, which the engine's stream
        waits for before reading them."""
        with phase_times.collect() as timings, self.gate:
            self.check_weights_awake("update_weights_from_tensor")  # before any handle is opened
            device = self.engine.model_runner.device
            with self._staging_stream(device):
                staged = self._open_and_check(serialized, load_format, device, timings)
            with self._staged_lock:
                self._staged.append(staged)
        return staged

    def _open_and_check(self, serialized: Sequence[str], load_format: str | None, device: torch.device,
                        timings: dict[str, float]) -> StagedUpdate:
        pairs = self.decode(serialized, load_format)
        try:
            from torpor.engine.loader import check_staged

            with phase("check"):
                self.manifest.check(pairs)
            check_staged(_model(self.engine), pairs)  # the meta dry run and the finite values (this stream)
            return StagedUpdate(pairs, _ready_event(device), timings)
        except BaseException:
            release_transfer_memory(pairs)
            raise

    def _staging_stream(self, device: torch.device) -> contextlib.AbstractContextManager:
        """CUDA: the engine's device and a stream of the staging thread's own, made through the driver as the
        engine's is (no PyTorch stream pool): its IPC event waits and finite checks neither queue behind the
        engine's copies nor hold them up, as the threads' shared default stream would. CPU: nothing."""
        if device.type != "cuda":
            return contextlib.nullcontext()
        torch.cuda.set_device(device)  # this thread's CUDA calls (IPC opens, range checks) go there
        if self._stage_stream is None:
            from torpor.engine.engine_stream import EngineStream

            self._stage_stream = EngineStream(device)  # kept with the receiver (streams are never destroyed)
        return torch.cuda.stream(self._stage_stream.stream)

    def apply_staged(self, staged: StagedUpdate, flush_cache: bool = True) -> int:
        """Engine thread: copy a staged update (checked by `stage`; the coverage is checked here when the engine
        needs a whole set), synchronize, then release it. One dropped by a sleep meanwhile, or with the weights
        asleep now, is a 409 and writes nothing."""
        try:
            with self._staged_lock:
                if staged in self._staged:
                    self._staged.remove(staged)
            if staged.dropped is not None:
                raise RuntimeError(staged.dropped)
            self.check_weights_awake("update_weights_from_tensor")
            if staged.ready is not None:  # the tensors were opened on another thread's stream
                torch.cuda.current_stream(self.engine.model_runner.device).wait_event(staged.ready)
            return self._copy(staged.pairs, flush_cache, staged=True)
        finally:
            self._release(staged.pairs)

    def _release(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """Engine thread, after a copy: the request's references to the trainer's memory go — all but the
        storages a `keeping` block keeps for the push's next requests."""
        with phase("release"):
            if self._keeping is not None:
                for _, tensor in pairs:
                    storage = tensor.untyped_storage()
                    self._keeping[(storage.device, storage.data_ptr())] = storage
            release_transfer_memory(pairs)

    def discard_staged(self, staged: StagedUpdate) -> None:
        """Release a staged update that will not be copied (its request was refused before its turn)."""
        with self._staged_lock:
            if staged in self._staged:
                self._staged.remove(staged)
        release_transfer_memory(staged.pairs)

    @contextlib.contextmanager
    def held(self, drop: bool) -> Iterator[None]:
        """Engine thread, around a sleep or wake: no payload is opened meanwhile (`stage` waits); with `drop`,
        every staged update is released first (its copy answers 409): no IPC mapping of a trainer stays open
        while the weights or the CUDA context go."""
        with self.gate:
            if drop:
                self._drop_staged("the weights went to sleep before this request's copy; nothing was written "
                                  "(wake them, then push again)")
            yield

    def _drop_staged(self, reason: str) -> None:
        with self._staged_lock:
            staged, self._staged = self._staged, []
        for update in staged:
            update.dropped = reason
            release_transfer_memory(update.pairs)
        self.forget()

    # ---- mappings kept through a push -----------------------------------------------------------------
    @contextlib.contextmanager
    def keeping(self, push_id: str, count: int, last: bool) -> Iterator[None]:
        """Engine thread, around one request of a push whose trainer flattens its buckets into `count` buffers
        reused in turn (torpor.rl.BucketRing): the storages the request opened stay open for the push's next
        requests (the `count` most recently used), so each buffer is opened once per push — torch finds an open
        storage by its handle and maps it again only when none is alive (`rebuild_cuda_tensor`,
        `rebuild_storage_filename`); its new IPC event is then not waited for, and the pusher synchronizes every
        bucket before sending it. After the push's `last` request, or a failed one, every storage kept for the
        push goes."""
        self._keeping = {}
        try:
            yield
        except BaseException:
            self._keeping = None
            self.forget(push_id)
            raise
        storages, self._keeping = self._keeping, None
        if last:
            self.forget(push_id)
        else:
            self._keep(push_id, storages, count)

    def _keep(self, push_id: str, storages: dict[tuple, torch.UntypedStorage], count: int) -> None:
        with self._staged_lock:
            kept = self._kept.setdefault(push_id, OrderedDict())
            for key, storage in storages.items():
                kept[key] = storage
                kept.move_to_end(key)
            released = [kept.popitem(last=False)[1] for _ in range(max(0, len(kept) - count))]
        released.clear()  # outside the lock: releasing a CUDA mapping is a driver call

    def forget(self, push_id: str | None = None) -> None:
        """Release the storages kept for the push `push_id` (None: for every push)."""
        with self._staged_lock:
            if push_id is None:
                released, self._kept = list(self._kept.values()), {}
            else:
                released = [self._kept.pop(push_id)] if push_id in self._kept else []
        released.clear()

    def kept(self, push_id: str | None = None) -> int:
        """How many storages are kept for `push_id` (None: for every push)."""
        with self._staged_lock:
            if push_id is None:
                return sum(len(k) for k in self._kept.values())
            return len(self._kept.get(push_id, ()))

    @property
    def discarded(self) -> bool:
        mode = self.engine.sleep_mode
        return mode is not None and mode.weights_discarded

    def commit(self, names: list[str], copy, flush_cache: bool) -> int:
        """Run `copy()` (checked tensors into the weights, on every rank; returns a count), then account for
        them: after a level-2 sleep the weights are valid once every checkpoint tensor came."""
        with phase("prepare"):
            self.check_weights_awake("update weights")
            engine, discarded = self.engine, self.discarded
            engine.mark_weights_dirty()  # every copy writes the weights (the ranks' own "apply" does not declare it)
            if discarded and (self.missing is None or self.discards_counted != engine.sleep_mode.discards):
                self.missing = {n for n in self.manifest.shapes if not _is_ignored(engine, n)}
                self.discards_counted = engine.sleep_mode.discards
        count = copy()
        with phase("sync"):
            _synchronize_copies(engine)  # copies done before the trainer may reuse its memory
        if discarded:
            self.missing -= set(names)
            if not self.missing:
                self.missing = None
                engine.model_runner.reset_buffers()  # discarded with the weights; the buckets left it (once here)
                engine._weights_restored()  # every tensor came: the weights are valid, serve again
        if flush_cache and not self.discarded:
            reset = getattr(engine, "reset_prefix_cache", None)
            if reset is not None:
                reset()
        return count

@dataclass(eq=False)
class StagedUpdate:
    """One request's tensors, opened and checked off the engine thread, waiting for their copy: `ready` is a
    CUDA event recorded after they were opened (None on CPU), `timings` the staging thread's phases, `dropped`
    why the copy will not happen (a sleep came first)."""

    pairs: list[tuple[str, torch.Tensor]]
    ready: object | None
    timings: dict[str, float]
    dropped: str | None = None


def _ready_event(device: torch.device):
    """An event on this thread's current stream of `device` (CUDA), after the work queued so far."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _model(engine):
    runner = engine.model_runner
    return runner.model if hasattr(runner, "model") else runner.local.model


def _synchronize_copies(engine) -> None:
    """An update's copies done. TP=1: they all ran on the engine's stream, so that stream only — the whole device
    would also wait for the staging thread's stream (the next request's finite check). Under tensor
    parallelism the device (rank 0's copies may also feed the engine group's collectives)."""
    runner = engine.model_runner
    stream = getattr(runner, "engine_stream", None)  # a ParallelRunner has none of its own
    if engine.config.tensor_parallel_size == 1 and stream is not None and stream.stream is not None:
        stream.stream.synchronize()
    else:
        _synchronize(runner.device)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_ignored(engine, name: str) -> bool:
    return bool(getattr(_model(engine), "is_ignored_weight", lambda n: False)(name))


def _describe(value) -> str:
    if isinstance(value, list | tuple):
        return f"a list of {len(value)}"
    return type(value).__name__


def release_transfer_memory(named_tensors: list) -> None:
    """Drop the references to the trainer's memory (IPC mappings, shared-memory files) and, on CUDA, let
    torch close the IPC handles now (`ipc_collect`)."""
    named_tensors.clear()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()


_receivers_lock = threading.Lock()  # a server's staging thread and its engine thread may both ask first


def receiver_of(engine) -> WeightReceiver:
    """The engine's WeightReceiver (made on first use; one per engine)."""
    receiver = getattr(engine, "_weight_receiver", None)
    if receiver is None:
        with _receivers_lock:
            receiver = getattr(engine, "_weight_receiver", None)
            if receiver is None:
                receiver = engine._weight_receiver = WeightReceiver(engine)
    return receiver


# ---- entry points (called with the engine to themselves: LLM's lock, or the server's engine thread) ----
def update_weights_from_tensor(engine, serialized_named_tensors: Sequence[str] | None = None,
                               load_format: str | None = None, flush_cache: bool = True,
                               named_tensors=None) -> int:
    """SGLang's `update_weights_from_tensor`: base64 payloads (one per rank), or, in process, the named
    tensors themselves (a list of pairs, or a flattened-bucket dict with load_format 'flattened_bucket').
    Returns how many tensors were loaded."""
    receiver = receiver_of(engine)
    receiver.check_weights_awake("update_weights_from_tensor")  # before any handle is opened
    if (serialized_named_tensors is None) == (named_tensors is None):
        raise ValueError("give exactly one of serialized_named_tensors and named_tensors")
    if not isinstance(flush_cache, bool):
        raise ValueError(f"flush_cache must be true or false, got {flush_cache!r}")
    tp = engine.config.tensor_parallel_size
    if named_tensors is not None:
        with phase("decode"):
            pairs = named_tensors_of(named_tensors if load_format else list(named_tensors), load_format)
    elif tp > 1 and isinstance(serialized_named_tensors, list | tuple) and len(serialized_named_tensors) == tp:
        return _per_rank_update(engine, receiver, list(serialized_named_tensors), load_format, flush_cache)
    else:
        pairs = receiver.decode(serialized_named_tensors, load_format)
    return receiver.apply(pairs, flush_cache)


def _per_rank_update(engine, receiver: WeightReceiver, serialized: list[str], load_format: str | None,
                     flush_cache: bool) -> int:
    """Tensor parallel with one payload per rank: every rank opens its own entry (on GPU: the trainer's rank
    on the same device) and checks it; only when every rank holds a checked bucket do they all copy."""
    runner = engine.model_runner
    try:
        names = runner.weights_group("open", serialized, load_format)
    except BaseException:
        runner.weights_group("drop", _OPENED)
        raise
    return receiver.commit(names, lambda: runner.weights_group("apply", _OPENED), flush_cache)


_OPENED = "\0opened"  # the staging key of a per-rank payload (no group name can hold a NUL)


# ---- the process-group transport ---------------------------------------------------------------------
@dataclass
class UpdateGroup:
    """One standalone process group to a trainer (rank `rank` of `world_size`; the trainer is rank 0)."""

    name: str
    rank: int
    world_size: int
    backend: str
    group: object  # ProcessGroupGloo / ProcessGroupNCCL
    device: torch.device
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S  # how long a receive waits for the trainer's broadcasts


_groups_lock = threading.Lock()  # every runner's groups (a server joins off the engine thread at TP=1)


def groups_of(runner) -> dict[str, UpdateGroup | None]:
    """One rank's groups, by name (None: reserved while it forms); they belong to its `ModelRunner` and go
    with it (`destroy_all_groups`), not with the process."""
    groups = getattr(runner, "_weight_groups", None)
    if groups is None:
        groups = runner._weight_groups = {}
    return groups


def open_update_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                      backend: str, device: torch.device, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
                      is_master: bool = False, give_up: Callable[[], str | None] | None = None) -> UpdateGroup:
    """Join (or, `is_master`: host) the standalone group `group_name`. Every rank checks in on the store
    first; a rank missing after `timeout_s` → WeightTransferError, and nothing is left behind. `give_up`:
    polled while waiting; a reason it returns ends the wait at once (e.g. the engine refused to join)."""
    _check_group_args(master_address, master_port, rank, world_size, group_name, backend, timeout_s)
    backend = _backend_for(backend, device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    # The communicator and its streams form on `device` (the caller's current device is given back after).
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        return _open_update_group(master_address, master_port, rank, world_size, group_name, backend, device,
                                  timedelta(seconds=timeout_s), is_master, give_up)


def _open_update_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                       backend: str, device: torch.device, timeout: timedelta, is_master: bool,
                       give_up: Callable[[], str | None] | None) -> UpdateGroup:
    import torch.distributed as dist

    timeout_s = timeout.total_seconds()
    try:
        store = dist.TCPStore(master_address, master_port, world_size, is_master, timeout=timeout,
                              wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        raise WeightTransferError(f"weights update group {group_name!r}: cannot reach the trainer's store at "
                                  f"{master_address}:{master_port} within {timeout_s:g} s: {e}") from None
    store = dist.PrefixStore(f"torpor-weights/{group_name}/", store)
    _rendezvous(store, rank, world_size, group_name, timeout_s, give_up)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    else:
        group = _nccl_group(store, rank, world_size, timeout)
    handle = UpdateGroup(group_name, rank, world_size, backend, group, device, timeout_s)
    try:
        broadcast(handle, torch.zeros(1, device=device))  # forms the communicator now (NCCL is lazy)
    except BaseException:
        destroy_group_handle(handle)  # nothing left behind
        raise
    return handle


# A receive gives up on the trainer at the group's timeout and aborts the communicator itself; NCCL's watchdog,
# which acts at its own timeout, gets this much longer, so the receive's error (and its roll-back) comes first.
_WATCHDOG_MARGIN = timedelta(seconds=30)
_nccl_env_lock = threading.Lock()


def _nccl_group(store, rank: int, world_size: int, timeout: timedelta):
    """A ProcessGroupNCCL whose watchdog, on an error or at its timeout, aborts the communicator and leaves the
    process alive (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, "clean up only", read by the constructor). PyTorch's default
    (3) ends the process: a trainer that died mid-update would take the serving engine with it."""
    import torch.distributed as dist

    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout + _WATCHDOG_MARGIN
    name = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    with _nccl_env_lock:  # the variable is the process's: set only while this group is made
        before = os.environ.get(name)
        os.environ[name] = "2"
        try:
            return dist.ProcessGroupNCCL(store, rank, world_size, options)
        finally:
            if before is None:
                del os.environ[name]
            else:
                os.environ[name] = before


def _rendezvous(store, rank: int, world_size: int, group_name: str, timeout_s: float,
                give_up: Callable[[], str | None] | None = None) -> None:
    store.set(f"joined/{rank}", b"1")
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [r for r in range(world_size) if not store.check([f"joined/{r}"])]
        if not missing:
            return
        reason = give_up() if give_up is not None else None
        if reason:
            raise WeightTransferError(f"weights update group {group_name!r} will not form: {reason}")
        if time.monotonic() > deadline:
            raise WeightTransferError(f"weights update group {group_name!r} did not form within {timeout_s:g} s: "
                                      f"rank(s) {missing[:8]} of {world_size} never joined")
        time.sleep(0.02)


def _check_group_args(address, port, rank, world_size, name, backend, timeout_s) -> None:
    if not isinstance(address, str) or not address:
        raise ValueError("master_address must be a host name or address")
    if not _is_int(port) or not 0 < port < 65536:
        raise ValueError(f"master_port must be a port number, got {port!r}")
    if not _is_int(world_size) or world_size < 2:
        raise ValueError(f"world_size must be an int >= 2 (the trainer and the engine's ranks), got {world_size!r}")
    if not _is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, world_size), got {rank!r}")
    if not isinstance(name, str) or not re.fullmatch(r"[\w.-]{1,128}", name):
        raise ValueError(f"group_name must be 1-128 letters, digits, '_', '.' or '-', got {name!r}")
    if backend not in (None, "nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if not isinstance(timeout_s, int | float) or not 0 < timeout_s <= 3600:
        raise ValueError(f"timeout must be in (0, 3600] seconds, got {timeout_s!r}")


def _backend_for(backend: str | None, device: torch.device) -> str:
    default = "nccl" if device.type == "cuda" else "gloo"
    backend = backend or default
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("backend 'nccl' needs a CUDA engine; on CPU use 'gloo'")
    return backend


def broadcast(group: UpdateGroup, tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's `tensor` into everyone's, in place. gloo: blocks until done (or the group's timeout); NCCL: the
    current stream waits for it (`await_work` waits for it on the host, within a timeout)."""
    _start_broadcast(group, tensor)
    return tensor


def _start_broadcast(group: UpdateGroup, tensor: torch.Tensor):
    """`broadcast`, returning its work (what `await_work` waits for)."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    work = group.group.broadcast([tensor], options)
    work.wait()
    return work


def await_work(last, timeout_s: float, poll_s: float = 1e-4) -> None:
    """Wait on the host until the collectives up to `last` (a process-group work; NCCL's run in order on the
    group's stream) are done, for at most `timeout_s`: a CUDA synchronize would wait forever for a trainer that
    died mid-broadcast. Raises TimeoutError at the deadline (the caller destroys the group: its abort ends the
    kernels still waiting), or the work's error if it ended in one."""
    deadline = time.monotonic() + timeout_s
    while not last.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the trainer's broadcasts did not complete within {timeout_s:g} s")
        time.sleep(poll_s)
    # Set when NCCL reported an error or the watchdog aborted the communicator (PyTorch calls the API deprecated and
    # says so once per process on stderr; a completed NCCL work has no other way to tell failure from success).
    error = last.exception()
    if error is not None:
        raise RuntimeError(f"the broadcast failed: {error}")


def init_weights_update_group(engine, master_address: str, master_port: int, rank_offset: int, world_size: int,
                              group_name: str, backend: str | None = None,
                              timeout: float = DEFAULT_GROUP_TIMEOUT_S) -> None:
    """SGLang's `init_weights_update_group`: every engine rank joins as `rank_offset + tp_rank`. Under tensor
    parallelism a rank that fails to join makes every rank leave again (no rank is left in the group)."""
    tp = engine.config.tensor_parallel_size
    if not _is_int(rank_offset) or rank_offset < 1:
        raise ValueError(f"rank_offset must be >= 1 (rank 0 is the trainer's broadcasting rank), got {rank_offset!r}")
    if _is_int(world_size) and rank_offset + tp > world_size:
        raise ValueError(f"world_size {world_size} cannot hold the engine's {tp} rank(s) from rank_offset "
                         f"{rank_offset} (needs at least {rank_offset + tp})")
    args = (master_address, master_port, rank_offset, world_size, group_name, backend, timeout)
    if tp == 1:
        rank_command(engine.model_runner, "init", *args)
        return
    runner = engine.model_runner
    if group_name in groups_of(runner.local):  # refused before any rank acts (the roll-back would destroy it)
        raise ValueError(f"weights update group {group_name!r} exists already; destroy it first")
    try:
        runner.weights_group("init", *args)
    except BaseException:
        runner.weights_group("drop", group_name)
        raise


def receive_named_tensors(runner, group_name: str, names: Sequence[str], dtypes: Sequence,
                          shapes: Sequence) -> list[tuple[str, torch.Tensor]]:
    """The trainer's broadcasts of `names` (in order) into fresh tensors on this rank's device. All
    checked before anything is received; a broadcast that fails (trainer gone, timeout) destroys the group
    and raises WeightTransferError. Nothing is written to the model here."""
    group = _group(runner, group_name)
    specs = _specs(names, dtypes, shapes)
    received, last = [], None
    for name, dtype, shape in specs:
        try:  # an allocation that fails leaves the group out of step with the trainer, as a failed broadcast does
            tensor = torch.empty(shape, dtype=dtype, device=group.device)
            last = _start_broadcast(group, tensor)
        except Exception as e:
            _give_up(runner, group_name, f"failed while receiving {name!r} ({len(received)} of {len(specs)} "
                     "received", e)
        received.append((name, tensor))
    try:  # gloo's works are done already (each raised its error at once)
        if group.backend == "nccl":
            await_work(last, group.timeout_s)
    except Exception as e:
        _give_up(runner, group_name, f"failed while receiving ({len(specs)} broadcasts started, not all arrived", e)
    _synchronize(group.device)  # the broadcasts ran on the group's stream; the copies run on the engine's
    return received


def _give_up(runner, group_name: str, what: str, error: Exception) -> NoReturn:
    """A receive that failed: the group is destroyed (it is out of step with the trainer), nothing was written."""
    destroy_update_group(runner, group_name)
    raise WeightTransferError(f"weights update group {group_name!r} {what}; nothing was written, the previous "
                              f"weights stay; the group is destroyed): {error}") from None


def _specs(names, dtypes, shapes) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    if not all(isinstance(v, list | tuple) for v in (names, dtypes, shapes)) or \
            not len(names) == len(dtypes) == len(shapes) or not names:
        raise ValueError("names, dtypes and shapes must be non-empty lists of the same length")
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if not isinstance(name, str):
            raise ValueError(f"names must be strings, got {name!r}")
        if not isinstance(shape, list | tuple) or not all(_is_int(d) and d >= 0 for d in shape):
            raise ValueError(f"shape of {name!r} must be a list of non-negative ints, got {shape!r}")
        specs.append((name, parse_dtype(dtype, f"dtype of {name!r}"), tuple(shape)))
    return specs


def _group(runner, group_name: str) -> UpdateGroup:
    with _groups_lock:
        groups = groups_of(runner)
        if group_name in groups and groups[group_name] is None:
            raise ValueError(f"weights update group {group_name!r} is still forming (init_weights_update_group)")
        group = groups.get(group_name)
    if group is None:
        raise ValueError(f"no weights update group {group_name!r}: call init_weights_update_group first")
    return group


def _reserve(groups: dict, group_name: str) -> None:
    """Hold `group_name` while it forms: a second init of it fails at once instead of replacing the first."""
    with _groups_lock:
        if group_name in groups:
            raise ValueError(f"weights update group {group_name!r} exists already; destroy it first")
        groups[group_name] = None


def update_weights_from_distributed(engine, names: Sequence[str], dtypes: Sequence, shapes: Sequence,
                                    group_name: str, flush_cache: bool = True) -> int:
    """SGLang's `update_weights_from_distributed`: every rank receives the trainer's broadcasts into fresh
    tensors; only once every rank has all of them are they copied (each rank keeps its shard). A failed
    receive on any rank drops what every rank received: nothing is written. Returns the tensors loaded.

    An update refused before its first receive (weights asleep, a name / shape / dtype the checkpoint does
    not have) destroys the group too: the trainer's broadcasts of it have no receiver, so the group's stream
    is out of step; the trainer's broadcasts fail at once instead of at the group's timeout."""
    receiver = receiver_of(engine)
    try:
        receiver.check_weights_awake("update_weights_from_distributed")
        specs = _specs(names, dtypes, shapes)
        receiver.manifest.check([(n, torch.empty(s, dtype=d, device="meta")) for n, d, s in specs])
    except (ValueError, RuntimeError) as e:
        if _abandon(engine, group_name):
            raise type(e)(f"{e} (weights update group {group_name!r} is destroyed: its stream is out of step "
                          "with the trainer; init it again)") from e
        raise
    names = [n for n, _, _ in specs]
    if engine.config.tensor_parallel_size == 1:
        pairs = receive_named_tensors(engine.model_runner, group_name, names, dtypes, shapes)
        return receiver.apply(pairs, flush_cache)
    runner = engine.model_runner
    try:
        runner.weights_group("receive", group_name, names, dtypes, shapes)
    except BaseException:
        runner.weights_group("drop", group_name)
        raise
    return receiver.commit(names, lambda: runner.weights_group("apply", group_name), flush_cache)


def _abandon(engine, group_name: str) -> bool:
    """Destroy `group_name` on every rank that has it; returns whether rank 0 had it."""
    runner = engine.model_runner
    if engine.config.tensor_parallel_size == 1:
        return destroy_update_group(runner, group_name)
    existed = _group_exists(runner.local, group_name)
    runner.weights_group("drop", group_name)
    return existed


def _group_exists(runner, group_name: str) -> bool:
    with _groups_lock:
        return groups_of(runner).get(group_name) is not None


def destroy_weights_update_group(engine, group_name: str) -> None:
    """SGLang's `destroy_weights_update_group` (every rank leaves)."""
    if engine.config.tensor_parallel_size == 1:
        rank_command(engine.model_runner, "destroy", group_name)
    else:
        engine.model_runner.weights_group("destroy", group_name)


# ---- one rank's part (rank 0 here; a tensor-parallel worker through its "weights_group" command) -----
_staged: dict[str, list[tuple[str, torch.Tensor]]] = {}  # received, not yet copied (this rank)


def rank_command(runner, op: str, *args):
    """One rank's part of a group operation: init, receive, apply, drop, destroy."""
    from torpor.engine.distributed import tp_rank

    if op == "init":
        address, port, rank_offset, world_size, group_name, backend, timeout = args
        groups = groups_of(runner)
        _reserve(groups, group_name)
        try:
            group = open_update_group(address, port, rank_offset + tp_rank(), world_size, group_name, backend,
                                      runner.device, timeout)
        except BaseException:
            with _groups_lock:
                groups.pop(group_name, None)
            raise
        with _groups_lock:
            groups[group_name] = group
        return None
    if op == "open":  # this rank's entry of a per-rank update_weights_from_tensor
        serialized, load_format = args
        manifest = _rank_manifest(runner)
        pairs = named_tensors_of(unpickle_payload(serialized[tp_rank()], manifest.max_bytes), load_format)
        manifest.check(pairs)
        _staged[_OPENED] = pairs
        return [name for name, _ in pairs]
    if op == "receive":
        group_name, names, dtypes, shapes = args
        _staged[group_name] = receive_named_tensors(runner, group_name, names, dtypes, shapes)
        return len(_staged[group_name])
    if op == "apply":
        (group_name,) = args
        tensors = _staged.pop(group_name)
        try:  # a partial set after a discard: the receiver's commit recomputes the RoPE table once complete
            count = runner.update_weights(tensors, strict=False, reset_buffers=False)
            _synchronize(runner.device)  # before the trainer's memory is released
            return count
        finally:
            release_transfer_memory(tensors)
    if op == "drop":  # a failed or refused update: its staged tensors go, and the group (out of step) with them
        _staged.pop(args[0], None)
        destroy_update_group(runner, args[0])
        return None
    if op == "destroy":
        _staged.pop(args[0], None)
        if not destroy_update_group(runner, args[0]):
            raise ValueError(f"no weights update group {args[0]!r}")
        return None
    raise ValueError(f"unknown weights group operation {op!r}")


_manifests: dict[str, Manifest] = {}  # this process's checkpoint manifests, by path


def _rank_manifest(runner) -> Manifest:
    path = runner.config.model
    if path not in _manifests:
        _manifests[path] = Manifest.of_checkpoint(path)
    return _manifests[path]


def destroy_update_group(runner, group_name: str) -> bool:
    """Forget the group (its communicator goes with the object). Returns whether it existed (one still
    forming is left to its init)."""
    with _groups_lock:
        groups = groups_of(runner)
        group = groups.pop(group_name) if groups.get(group_name) is not None else None
    if group is None:
        return False
    destroy_group_handle(group)
    return True


def destroy_all_groups(runner) -> None:
    """Every group of this rank (its engine closes): their sockets and threads go now."""
    with _groups_lock:
        names = [name for name, group in groups_of(runner).items() if group is not None]
    for name in names:
        destroy_update_group(runner, name)


def destroy_group_handle(group: UpdateGroup) -> None:
    """End one group's communicator (NCCL: abort it; gloo: its sockets close with the object)."""
    abort = getattr(group.group, "abort", None)
    if group.backend == "nccl" and abort is not None:
        abort()
