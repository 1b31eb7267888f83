"""Weight payloads from a trainer process: the restricted unpickler of `torch.multiprocessing` pickles (torch's
tensor and storage rebuild functions, dtypes, `torch.Size`, `torch.device` and plain containers only; every
shared-memory name and size and every CUDA IPC range checked before it is mapped; anything else refused without
being called) and the payload shapes SGLang's clients send (a list of (name, tensor) pairs, or flattened
buckets). Imports nothing of the engine."""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import re
import reprlib
from collections import OrderedDict
from typing import ClassVar

import torch

from torpor.engine.phase_times import phase
from torpor.engine.weights import shm

MAX_SERIALIZED_CHARS = 64 << 20  # one rank's base64 payload (handles, not data: an 8B model is ~15 KB)
MAX_TENSORS_PER_PAYLOAD = 100_000

_DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float16", "bfloat16", "float64", "uint8", "int8", "int16", "int32", "int64", "bool")}



class RefusedPickle(ValueError):
    """A payload that names anything but tensors, storages and plain containers (it is never called)."""



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
        """A shared-memory file, mapped by `shm.open_shared` (never through the trainer's torch_shm_manager: the
        manager's name is checked, never connected to)."""
        manager, handle = _text(manager), _text(handle)
        if cls not in (_UNTYPED, _TYPED) or not is_int(size) or size < 0 or \
                (dtype is not None and not isinstance(dtype, torch.dtype)):
            raise RefusedPickle("a shared-memory storage with malformed arguments")
        if handle is None or not shm.is_torch_name(handle):
            raise RefusedPickle(f"shared-memory name {reprlib.repr(handle)} is not a torch shared-memory file")
        if manager is None or not _SHM_MANAGER.fullmatch(manager):
            raise RefusedPickle(f"{reprlib.repr(manager)} is not a torch_shm_manager socket")
        nbytes = size * (torch._utils._element_size(dtype) if dtype is not None else 1)
        self._count(nbytes)
        with phase("open"):  # inside "decode": the shared-memory file mapped
            storage = shm.open_shared(handle, nbytes)
        if dtype is None:
            return storage
        return torch.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

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
                or not is_int(device) or not all(is_int(v) and v >= 0 for v in
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
    if not isinstance(dims, tuple | list) or not all(is_int(d) for d in dims):
        raise RefusedPickle("torch.Size takes a tuple of ints")
    return torch.Size(dims)


def _device(kind, index=None) -> torch.device:
    """`torch.device` of a type name and an optional index only."""
    if not isinstance(kind, str) or not (index is None or is_int(index)):
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


def is_int(value) -> bool:
    """An int that is not a bool (JSON's true is no port number)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_layout(size, stride, offset) -> None:
    ok = isinstance(size, tuple) and isinstance(stride, tuple) and len(size) == len(stride) <= 8 and \
        all(is_int(v) and 0 <= v < 1 << 63 for v in (*size, *stride, offset))
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
    if not isinstance(shape, list | tuple) or not all(is_int(d) and 0 <= d < 1 << 63 for d in shape):
        raise ValueError(f"metadata of {name!r}: shape must be a list of non-negative 64-bit ints")
    if not is_int(start) or not is_int(end):
        raise ValueError(f"metadata of {name!r}: start and end must be ints")
    return name, tuple(shape), parse_dtype(dtype, f"metadata of {name!r}"), start, end


def parse_dtype(value, what: str) -> torch.dtype:
    """A torch.dtype, or its name ("bfloat16", "torch.bfloat16")."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise ValueError(f"{what}: unknown dtype {reprlib.repr(value)}")


