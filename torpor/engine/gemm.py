"""y = x W^T (+ b) for the model's layers: cuBLASLt on CUDA (cublaslt.py says why not F.linear there),
F.linear on CPU or on the streams of an engine configured with `gemm="torch"`.

Workspaces are per CUDA stream (cuBLASLt's split-K kernels must not share one across streams): the
engine registers its stream's workspace, made inside its `workspace` memory tag, so it sleeps and wakes
with the engine at the same address (captured graphs hold it). The choice of GEMM is per stream too, so
two engines of one process may choose differently."""

from __future__ import annotations

import contextlib
import contextvars
import threading
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from torpor.engine.cublaslt import CublasLt, CublasLtError

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
_BACKENDS: dict[int, object] = {}  # device index -> CublasLt, or None where cuBLASLt cannot be used
_WORKSPACES: dict[int, torch.Tensor | None] = {}  # CUDA stream handle -> workspace (None: F.linear there)
_LOCK = threading.Lock()


def workspace_bytes(device: torch.device) -> int:
    """cuBLAS's recommended workspace: 32 MiB on Hopper and later, 4 MiB before."""
    return (32 if torch.cuda.get_device_capability(device)[0] >= 9 else 4) << 20


def set_workspace(stream: int, workspace: torch.Tensor | None, use_torch: bool = False) -> None:
    """Register the workspace GEMMs enqueued on `stream` use; `use_torch`: F.linear there instead (an engine
    with `gemm="torch"`)."""
    _WORKSPACES[stream] = None if use_torch else workspace


def drop_workspace(stream: int) -> None:
    """Forget `stream`'s workspace (its engine closed)."""
    _WORKSPACES.pop(stream, None)


_ROW_INVARIANT = contextvars.ContextVar("torpor_row_invariant_gemms", default=False)
CPU_ROW_MULTIPLE = 16  # see row_invariant()


@contextlib.contextmanager
def row_invariant() -> Iterator[None]:
    """Within: every row of `linear`'s output is computed the same however many rows come with it. The
    engine's prefills run so, so that a prompt prefilled after a cached prefix (a few rows) gets the bits of
    the same prompt prefilled whole (many rows): prefix caching changes no answer. On CUDA one cuBLASLt
    algorithm per weight shape serves every row count (cublaslt.py); on CPU the rows are padded to a multiple
    of CPU_ROW_MULTIPLE (PyTorch's CPU GEMMs compute a row differently when the row count leaves a remainder
    of 1-3; measured, fp32). Not with `gemm="torch"` on CUDA."""
    token = _ROW_INVARIANT.set(True)
    try:
        yield
    finally:
        _ROW_INVARIANT.reset(token)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., k], weight [n, k], bias [n] or None -> [..., n], like F.linear."""
    if not x.is_cuda:
        return _cpu_linear(x, weight, bias) if _ROW_INVARIANT.get() else F.linear(x, weight, bias)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    if x.dtype not in _SUPPORTED or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype) or (
            stream in _WORKSPACES and _WORKSPACES[stream] is None):
        return F.linear(x, weight, bias)
    backend = _backend(x.device)
    if backend is None:
        return F.linear(x, weight, bias)
    return backend.linear(x, weight, bias, stream, _WORKSPACES.get(stream), row_invariant=_ROW_INVARIANT.get())


def _cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    pad = -rows.shape[0] % CPU_ROW_MULTIPLE
    if not pad:
        return F.linear(x, weight, bias)
    rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    return F.linear(rows, weight, bias)[:-pad].view(*x.shape[:-1], weight.shape[0])


def _backend(device: torch.device):
    if device.index in _BACKENDS:
        return _BACKENDS[device.index]

    with _LOCK:
        if device.index not in _BACKENDS:
            try:
                _BACKENDS[device.index] = CublasLt(device)
            except CublasLtError as exc:  # e.g. a build of torch without cuBLASLt: right answers, more memory
                warnings.warn(f"torpor: GEMMs fall back to F.linear on {device} ({exc}); PyTorch's cuBLAS handle "
                              "then keeps ~66 MiB of device memory while the engine sleeps", stacklevel=3)
                _BACKENDS[device.index] = None
    return _BACKENDS[device.index]
