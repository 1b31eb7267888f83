"""The engine's GEMMs on CUDA: cuBLASLt called directly (ctypes on the library PyTorch loaded), one
handle per device, the workspace handed in by the caller.

Why not `F.linear`: PyTorch runs its GEMMs on a cuBLAS handle per thread, and `cublasCreate` allocates
a workspace pool of its own (66 MiB on an H200) that PyTorch never uses (it gives the handle its own
workspace) and never frees: device memory that would stay while the engine sleeps. Shrinking the pool
with CUBLAS_WORKSPACE_CONFIG makes cuBLAS pick 3-4x slower kernels for the decode shapes (both measured,
docs/sleep-mode.md). A cuBLASLt handle costs no device memory, and the workspace here is the engine's,
in its `workspace` memory tag. The kernels are cuBLAS's, chosen by cuBLASLt's heuristic, as PyTorch's
cuBLASLt path does.

Each (shape, dtype, alignment, workspace size) gets a plan, made once: the operation and layout
descriptors and the heuristic's algorithm. A call then costs one ctypes call to `cublasLtMatmul`, which
CUDA graphs capture like any kernel launch.

Row-invariant calls (the engine's prefills, see gemm.row_invariant) use one algorithm per weight shape for
every row count m: the heuristic's choice for INVARIANT_ROWS rows and no workspace (so no split-K
reduction). An algorithm computes each output element by the same sequence of operations whatever m is;
a per-m choice would give a row of a 3-row GEMM other bits than the same row of a 3,000-row one.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections import OrderedDict
from typing import NamedTuple

import torch

_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF = 0, 2, 14
_DATA_TYPES = {torch.float32: _CUDA_R_32F, torch.float16: _CUDA_R_16F, torch.bfloat16: _CUDA_R_16BF}
_COMPUTE_32F, _COMPUTE_32F_FAST_TF32 = 68, 77
_OP_N, _OP_T = 0, 1
# cublasLtMatmulDescAttributes_t
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_EPILOGUE_DEFAULT, _EPILOGUE_BIAS = 1, 4
# cublasLtMatmulPreferenceAttributes_t
_PREF_MAX_WORKSPACE_BYTES, _PREF_MIN_ALIGNMENT_A, _PREF_MIN_ALIGNMENT_B, _PREF_MIN_ALIGNMENT_D = 1, 5, 6, 8
_PREF_MIN_ALIGNMENT_C = 7
MAX_PLANS = 4096  # distinct prefill lengths make new plans; the least recently used go beyond this
INVARIANT_ROWS = 512  # the row count whose heuristic algorithm serves every row count of a row-invariant call
_ONE, _ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)  # alpha, beta (host scalars, float for every dtype)
logger = logging.getLogger("torpor.engine")


class CublasLtError(RuntimeError):
    pass


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class _Key(NamedTuple):
    dtype: torch.dtype
    m: int  # rows of x and y
    n: int  # output features (rows of the weight)
    k: int  # input features
    ld_x: int  # x's row stride (elements)
    bias: bool
    align_x: int
    align_w: int
    align_y: int
    workspace_bytes: int
    tf32: bool
    row_invariant: bool = False


class _Plan(NamedTuple):
    desc: ctypes.c_void_p
    layouts: tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]  # weight, x, y
    algo: _HeuristicResult


@functools.cache
def _library() -> ctypes.CDLL:
    """libcublasLt as PyTorch loaded it (the same copy its own GEMMs use)."""
    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "/libcublasLt.so" in line})
    try:
        lib = ctypes.CDLL(paths[0] if paths else "libcublasLt.so")
    except OSError as exc:
        raise CublasLtError(f"cuBLASLt is not loadable in this process ({exc})") from exc
    void_p, size_t = ctypes.c_void_p, ctypes.c_size_t
    lib.cublasLtMatmul.argtypes = [void_p, void_p, void_p, void_p, void_p, void_p, void_p, void_p, void_p, void_p,
                                   void_p, void_p, void_p, void_p, size_t, void_p]
    lib.cublasLtMatrixLayoutCreate.argtypes = [void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [void_p, ctypes.c_int, void_p, size_t]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [void_p, ctypes.c_int, void_p, size_t]
    return lib


def _alignment(address: int) -> int:
    return min(256, address & -address) if address else 256


class CublasLt:
    """cuBLASLt GEMMs on one device: `linear(x, weight, bias, workspace)` = x W^T (+ b)."""

    def __init__(self, device: torch.device) -> None:
        self.lib = _library()
        self.device = device
        self.handle = ctypes.c_void_p()
        with torch.cuda.device(device):
            self._check("cublasLtCreate", self.lib.cublasLtCreate(ctypes.byref(self.handle)))
        self._plans: OrderedDict[_Key, _Plan] = OrderedDict()
        self._refused: set[tuple[int, int, torch.dtype]] = set()  # weight shapes logged (_invariant_algo)
        self._lock = threading.Lock()  # plans are shared; a bias plan's pointer is set per call

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stream: int,
               workspace: torch.Tensor | None, row_invariant: bool = False) -> torch.Tensor:
        """x [..., k] @ weight [n, k]^T (+ bias [n]) -> [..., n], enqueued on `stream` (a CUDA stream handle of
        the device); `workspace` (uint8, on the device, used by no other stream) lets cuBLASLt pick split-K
        kernels (None: only algorithms that need none). `row_invariant`: one algorithm for every row count
        (see the module's docstring)."""
        n, k = weight.shape
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        if x2.stride(-1) != 1 or (m > 1 and x2.stride(0) < k):  # rows must be dense and apart (a valid ld)
            x2 = x2.contiguous()
        weight = weight.contiguous()
        bias = None if bias is None else bias.contiguous()
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if m > 0:
            ld_x = k if m == 1 else x2.stride(0)
            ws = None if row_invariant else workspace  # row-invariant algorithms take none (no split-K)
            ws_ptr, ws_bytes = (ws.data_ptr(), ws.numel()) if ws is not None else (0, 0)
            key = _Key(x.dtype, m, n, k, ld_x, bias is not None, _alignment(x2.data_ptr()),
                       _alignment(weight.data_ptr()), _alignment(y.data_ptr()), ws_bytes,
                       x.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32, row_invariant)
            with self._lock:
                plan = self._plan(key)
                if bias is not None:
                    ptr = ctypes.c_void_p(bias.data_ptr())
                    self._check("cublasLtMatmulDescSetAttribute(bias)", self.lib.cublasLtMatmulDescSetAttribute(
                        plan.desc, _DESC_BIAS_POINTER, ctypes.byref(ptr), ctypes.sizeof(ptr)))
                w_layout, x_layout, y_layout = plan.layouts
                status = self.lib.cublasLtMatmul(
                    self.handle, plan.desc, ctypes.byref(_ONE), weight.data_ptr(), w_layout, x2.data_ptr(),
                    x_layout, ctypes.byref(_ZERO), y.data_ptr(), y_layout, y.data_ptr(), y_layout,
                    ctypes.byref(plan.algo.algo), ws_ptr, ws_bytes, stream)
            self._check(f"cublasLtMatmul (m={m}, n={n}, k={k}, {x.dtype})", status)
        return y.view(*x.shape[:-1], n)

    def _plan(self, key: _Key) -> _Plan:
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        plan = self._make_plan(key)
        self._plans[key] = plan
        if len(self._plans) > MAX_PLANS:
            self._destroy(self._plans.popitem(last=False)[1])
        return plan

    def _make_plan(self, key: _Key) -> _Plan:
        """Column-major view of y = x W^T: y^T [n, m] = op_T(W as [k, n]) @ x^T [k, m]."""
        lib, dtype = self.lib, _DATA_TYPES[key.dtype]
        desc = ctypes.c_void_p()
        self._check("cublasLtMatmulDescCreate", lib.cublasLtMatmulDescCreate(
            ctypes.byref(desc), _COMPUTE_32F_FAST_TF32 if key.tf32 else _COMPUTE_32F, _CUDA_R_32F))
        for attribute, value in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N),
                                 (_DESC_EPILOGUE, _EPILOGUE_BIAS if key.bias else _EPILOGUE_DEFAULT)):
            self._set(lib.cublasLtMatmulDescSetAttribute, desc, attribute, ctypes.c_int32(value))
        layouts = []
        for rows, cols, ld in ((key.k, key.n, key.k), (key.k, key.m, key.ld_x), (key.n, key.m, key.n)):
            layout = ctypes.c_void_p()
            self._check("cublasLtMatrixLayoutCreate", lib.cublasLtMatrixLayoutCreate(
                ctypes.byref(layout), dtype, rows, cols, ld))
            layouts.append(layout)
        algo = self._invariant_algo(key, desc, layouts) if key.row_invariant else self._heuristic(key, desc, layouts)
        return _Plan(desc, (layouts[0], layouts[1], layouts[2]), algo)

    def _invariant_algo(self, key: _Key, desc: ctypes.c_void_p, layouts: list[ctypes.c_void_p]) -> _HeuristicResult:
        """The algorithm of this weight shape's reference plan (INVARIANT_ROWS dense rows, 16-byte alignment,
        no workspace) for `key`'s row count. Where cuBLASLt refuses it (an operand aligned below 16 bytes),
        the heuristic's own choice, logged at debug level: right answers, but that row count's bits may differ
        from the same rows computed in a batch of another size (the engine's answers are still bit-identical
        across sleep and wake: the same batch gets the same plan)."""
        reference = self._plan(key._replace(m=INVARIANT_ROWS, ld_x=key.k, align_x=16, align_w=16, align_y=16,
                                            row_invariant=False))
        checked = _HeuristicResult()
        w, x, y = layouts
        status = self.lib.cublasLtMatmulAlgoCheck(self.handle, desc, w, x, y, y, ctypes.byref(reference.algo.algo),
                                                  ctypes.byref(checked))
        if status == 0 and checked.workspace_size == 0:
            return reference.algo
        if (key.n, key.k, key.dtype) not in self._refused:  # once per weight shape, not per row count
            self._refused.add((key.n, key.k, key.dtype))
            logger.debug("cuBLASLt's row-invariant algorithm does not serve m=%d, n=%d, k=%d (%s, alignments "
                         "%d/%d/%d; cublasStatus %d): such rows may differ in the last bits from the same rows "
                         "computed in another batch", key.m, key.n, key.k, key.dtype, key.align_x, key.align_w,
                         key.align_y, status)
        return self._heuristic(key, desc, layouts)

    def _heuristic(self, key: _Key, desc: ctypes.c_void_p, layouts: list[ctypes.c_void_p]) -> _HeuristicResult:
        lib = self.lib
        pref = ctypes.c_void_p()
        self._check("cublasLtMatmulPreferenceCreate", lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)))
        try:
            set_pref = lib.cublasLtMatmulPreferenceSetAttribute
            self._set(set_pref, pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(key.workspace_bytes))
            for attribute, align in ((_PREF_MIN_ALIGNMENT_A, key.align_w), (_PREF_MIN_ALIGNMENT_B, key.align_x),
                                     (_PREF_MIN_ALIGNMENT_C, key.align_y), (_PREF_MIN_ALIGNMENT_D, key.align_y)):
                self._set(set_pref, pref, attribute, ctypes.c_uint32(align))
            result, count = _HeuristicResult(), ctypes.c_int(0)
            w, x, y = layouts
            self._check("cublasLtMatmulAlgoGetHeuristic", lib.cublasLtMatmulAlgoGetHeuristic(
                self.handle, desc, w, x, y, y, pref, 1, ctypes.byref(result), ctypes.byref(count)))
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        if count.value < 1:
            raise CublasLtError(f"cuBLASLt has no algorithm for m={key.m}, n={key.n}, k={key.k}, {key.dtype}")
        return result

    def _set(self, setter, obj: ctypes.c_void_p, attribute: int, value) -> None:
        self._check(f"{setter.__name__}({attribute})", setter(obj, attribute, ctypes.byref(value),
                                                              ctypes.sizeof(value)))

    def _destroy(self, plan: _Plan) -> None:
        for layout in plan.layouts:
            self.lib.cublasLtMatrixLayoutDestroy(layout)
        self.lib.cublasLtMatmulDescDestroy(plan.desc)

    @staticmethod
    def _check(call: str, status: int) -> None:
        if status != 0:
            raise CublasLtError(f"{call} failed: cublasStatus {status}")
