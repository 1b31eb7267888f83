"""Streaming safetensors writer: the header first (all shapes are known up front), then each tensor's
bytes as soon as it exists, so a 16 GB checkpoint never has to sit in memory."""

import json
import math
import struct
from typing import BinaryIO

import torch

SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def write_header(f: BinaryIO, specs: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> None:
    """Header for tensors `specs` (name, shape), all of `dtype`, whose data follow in the same order."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in specs:
        end = offset + tensor_nbytes(shape, dtype)
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data start 8-byte aligned
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)


def write_tensor(f: BinaryIO, tensor: torch.Tensor) -> None:
    """Raw little-endian bytes of a contiguous CPU tensor, without an extra copy."""
    f.write(tensor.contiguous().view(-1).view(torch.uint8).numpy())
