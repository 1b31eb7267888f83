"""The safetensors files of a checkpoint folder and their headers: the index types every weights module
shares (a leaf: it imports nothing of the engine). `CheckpointError` is the one error of a checkpoint that
cannot be loaded."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class CheckpointError(ValueError):
    """A checkpoint (or weight update) that cannot be loaded; the message names the file and the problem.
    `weights_written`: the failure came after some parameters were written (they are now invalid)."""

    def __init__(self, message: str, weights_written: bool = False) -> None:
        super().__init__(message)
        self.weights_written = weights_written


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, from its header: where its bytes lie, not the bytes."""

    name: str
    file: Path
    label: str  # the file's name relative to the checkpoint folder (for messages)
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    nbytes: int


@dataclass(frozen=True)
class PlannedCopy:
    """`dst` (a view of a real parameter) receives the elements `src` (a meta view of the source tensor:
    its offset and strides say which elements) of the source tensor named `name`."""

    name: str
    dst: torch.Tensor
    src: torch.Tensor


# ---- files and headers ----------------------------------------------------------------------------
def checkpoint_bytes(path: str | Path) -> int:
    """The bytes of a checkpoint's files (0 when it has none it can name: the load reports why)."""
    try:
        return sum(f.stat().st_size for f in checkpoint_files(path))
    except (OSError, ValueError):
        return 0


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: the shards listed by the index, or the single file.
    Shard names must stay inside the folder (no absolute names, no `..`); a file in the folder may be a
    symlink to elsewhere, as in a Hugging Face cache snapshot (whose files link to `../../blobs/`): the
    folder's owner put it there. (The server's `/reload_weights`, given a folder by a client, resolves every
    file itself against its allowed directory.)"""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint folder {path} does not exist")
    if (path / INDEX_FILE).is_file():
        return [_shard_path(path, name) for name in sorted(set(_weight_map(path).values()))]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


def _weight_map(path: Path) -> dict:
    try:
        index = json.loads((path / INDEX_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{INDEX_FILE}: not a readable JSON index ({type(e).__name__})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not weight_map or not isinstance(weight_map, dict):
        raise CheckpointError(f"{INDEX_FILE} has no weight_map")
    if not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{INDEX_FILE}: every weight_map value must be a file name")
    return weight_map


def _shard_path(root: Path, name: str) -> Path:
    """The shard `name` listed by the index, refused unless it is a .safetensors file inside `root`."""
    shown = name[:200]
    if os.path.isabs(name) or ".." in Path(name).parts or "\\" in name or "\0" in name:
        raise CheckpointError(f"{INDEX_FILE}: shard name {shown!r} leaves the checkpoint folder")
    if not name.endswith(".safetensors"):
        raise CheckpointError(f"{INDEX_FILE}: shard name {shown!r} is not a .safetensors file")
    file = root / name
    if not file.is_file():
        raise CheckpointError(f"{shown}: shard listed in {INDEX_FILE} is missing")
    return file


def read_header(file: Path, label: str) -> list[TensorEntry]:
    """The tensors of one safetensors file, from its header alone; CheckpointError for a truncated,
    empty or garbage file, or a header whose byte ranges do not fit the file."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{label}: truncated ({size} bytes, not a safetensors file)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{label}: not a safetensors file (header length {header_len} does not fit "
                                      f"the file's {size} bytes)")
            blob = f.read(header_len)
    except OSError as e:
        raise CheckpointError(f"{label}: cannot be read ({e.strerror or type(e).__name__})") from None
    try:
        header = json.loads(blob, object_pairs_hook=_unique_keys)
    except _DuplicateKeyError as e:
        raise CheckpointError(f"{label}: garbage header ({e})") from None
    except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested past Python's recursion limit
        raise CheckpointError(f"{label}: garbage header (not JSON; not a safetensors file)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{label}: garbage header (not a JSON object)")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{label}: __metadata__ is not an object of strings (not a safetensors file)")
    data_start, data_size = 8 + header_len, size - 8 - header_len
    entries = [_entry(file, label, name, info, data_start, data_size)
               for name, info in header.items() if name != "__metadata__"]
    _check_layout(entries, label, data_start, data_start + data_size)
    return entries


class _DuplicateKeyError(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object as a dict; _DuplicateKeyError for a key given twice (json.loads keeps the last)."""
    result: dict = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKeyError(f"{key[:200]!r} appears twice")
        result[key] = value
    return result


def _check_layout(entries: list[TensorEntry], label: str, data_start: int, data_end: int) -> None:
    """The safetensors library's rule: the tensors' byte ranges tile the data section, no overlap, no gap,
    nothing after the last (so both loaders accept the same files, and no two tensors share bytes)."""
    at = data_start
    for entry in sorted(entries, key=lambda e: (e.start, e.nbytes)):
        if entry.start != at:
            problem = "overlaps the tensor before it" if entry.start < at else f"leaves {entry.start - at} bytes unused"
            raise CheckpointError(f"{label}: tensor {entry.name[:200]!r}: data_offsets {problem} "
                                  "(not a safetensors file)")
        at += entry.nbytes
    if at != data_end:
        raise CheckpointError(f"{label}: {data_end - at} bytes after the last tensor's data (not a safetensors file)")


def _entry(file: Path, label: str, name: str, info: object, data_start: int, data_size: int) -> TensorEntry:
    def bad(problem: str) -> CheckpointError:
        return CheckpointError(f"{label}: tensor {name[:200]!r}: {problem}")

    if not isinstance(info, dict):
        raise bad("header entry is not an object")
    dtype_name = info.get("dtype")
    dtype = SAFETENSORS_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise bad(f"unknown dtype {str(dtype_name)[:20]!r}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 63
                                              for d in shape):
        raise bad("shape is not a list of non-negative 64-bit integers")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise bad("data_offsets is not a pair of integers")
    begin, end = offsets
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    if not 0 <= begin <= end or end - begin != nbytes:
        raise bad(f"data_offsets {offsets} do not match shape {shape} of {info['dtype']}")
    if end > data_size:
        raise bad(f"data ends at byte {end} but the file holds {data_size} (truncated)")
    return TensorEntry(name, file, label, dtype, tuple(shape), data_start + begin, nbytes)


def read_headers(path: str | Path) -> list[TensorEntry]:
    """Every tensor of the checkpoint folder `path`, from the headers (each name once)."""
    root = Path(path)
    entries: list[TensorEntry] = []
    seen: dict[str, str] = {}
    for file in checkpoint_files(root):
        label = file.relative_to(root).as_posix()
        for entry in read_header(file, label):
            if entry.name in seen:
                raise CheckpointError(f"{label}: tensor {entry.name!r} is also in {seen[entry.name]}")
            seen[entry.name] = label
            entries.append(entry)
    return entries

