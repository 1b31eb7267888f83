"""y = x W^T (+ b) for the model's layers: cuBLASLt on CUDA (cublaslt.py says why not F.linear there),
F.linear on CPU or when TORPOR_GEMM=torch.

Workspaces are per CUDA stream (cuBLASLt's split-K kernels must not share one across streams): the
engine registers its stream's workspace, made inside its `workspace` memory tag, so it sleeps and wakes
with the engine at the same address (captured graphs hold it)."""

from __future__ import annotations

import functools
import threading
import warnings

import torch
import torch.nn.functional as F

from torpor.env import Env

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
_BACKENDS: dict[int, object] = {}  # device index -> CublasLt, or None where cuBLASLt cannot be used
_WORKSPACES: dict[int, torch.Tensor] = {}  # CUDA stream handle -> workspace
_LOCK = threading.Lock()


def workspace_bytes(device: torch.device) -> int:
    """cuBLAS's recommended workspace: 32 MiB on Hopper and later, 4 MiB before."""
    return (32 if torch.cuda.get_device_capability(device)[0] >= 9 else 4) << 20


def set_workspace(stream: int, workspace: torch.Tensor | None) -> None:
    """Register (or with None drop) the workspace GEMMs enqueued on `stream` use."""
    if workspace is None:
        _WORKSPACES.pop(stream, None)
    else:
        _WORKSPACES[stream] = workspace


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., k], weight [n, k], bias [n] or None -> [..., n], like F.linear."""
    if not x.is_cuda or x.dtype not in _SUPPORTED or weight.dtype != x.dtype or _use_torch() or (
            bias is not None and bias.dtype != x.dtype):
        return F.linear(x, weight, bias)
    backend = _backend(x.device)
    if backend is None:
        return F.linear(x, weight, bias)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    return backend.linear(x, weight, bias, stream, _WORKSPACES.get(stream))


def _backend(device: torch.device):
    if device.index in _BACKENDS:
        return _BACKENDS[device.index]
    from torpor.engine.cublaslt import CublasLt, CublasLtError

    with _LOCK:
        if device.index not in _BACKENDS:
            try:
                _BACKENDS[device.index] = CublasLt(device)
            except CublasLtError as exc:  # e.g. a build of torch without cuBLASLt: right answers, more memory
                warnings.warn(f"torpor: GEMMs fall back to F.linear on {device} ({exc}); PyTorch's cuBLAS handle "
                              "then keeps ~66 MiB of device memory while the engine sleeps", stacklevel=3)
                _BACKENDS[device.index] = None
    return _BACKENDS[device.index]


@functools.cache
def _use_torch() -> bool:
    """TORPOR_GEMM, read once."""
    return Env.read().gemm == "torch"
