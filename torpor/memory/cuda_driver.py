"""Checked access to the CUDA driver API through NVIDIA's cuda-bindings (`cuda.bindings.driver`).

Everything torpor needs from the driver: virtual-memory reservation and mapping, pinned host
memory, asynchronous copies and memsets. Each wrapper raises `CudaDriverError` with the call's
name and the driver's error name instead of returning an error code.
"""

from __future__ import annotations

import functools
from typing import Any


class CudaDriverError(RuntimeError):
    def __init__(self, call: str, code: Any) -> None:
        self.code = code
        self.out_of_memory = getattr(code, "name", "") == "CUDA_ERROR_OUT_OF_MEMORY"
        super().__init__(f"{call} failed: {getattr(code, 'name', code)}")


@functools.cache
def driver() -> Any:
    """The `cuda.bindings.driver` module, or a clear ImportError saying how to install it."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:
        raise ImportError(
            "torpor's CUDA memory backend needs NVIDIA's cuda-bindings: install `torpor[cu12]` for a "
            "CUDA 12 driver or `torpor[cu13]` for a CUDA 13 driver (pip install 'cuda-bindings>=13,<14')"
        ) from exc
    return cu


def check(call: str, result: Any) -> Any:
    """Unpack a cuda-bindings result tuple `(err, *values)`; raise on error."""
    cu = driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaDriverError(call, err)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


class VirtualMemory:
    """Physical allocations mapped into reserved address ranges on one device."""

    def __init__(self, device_index: int) -> None:
        cu = driver()
        self.cu = cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_index
        self.prop = prop
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device_index
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access = access
        flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self.granularity = int(check("cuMemGetAllocationGranularity",
                                     cu.cuMemGetAllocationGranularity(prop, flag)))

    def round_up(self, size: int) -> int:
        g = self.granularity
        return (size + g - 1) // g * g

    def reserve(self, size: int) -> int:
        return int(check("cuMemAddressReserve", self.cu.cuMemAddressReserve(size, self.granularity, 0, 0)))

    def free_range(self, address: int, size: int) -> None:
        check("cuMemAddressFree", self.cu.cuMemAddressFree(address, size))

    def map(self, address: int, size: int) -> Any:
        """Create `size` bytes of device memory and map them at `address`; returns the handle.
        Raises CudaDriverError (`.out_of_memory` set when the device is full)."""
        cu = self.cu
        handle = check("cuMemCreate", cu.cuMemCreate(size, self.prop, 0))
        try:
            check("cuMemMap", cu.cuMemMap(address, size, 0, handle, 0))
        except CudaDriverError:
            cu.cuMemRelease(handle)
            raise
        try:
            check("cuMemSetAccess", cu.cuMemSetAccess(address, size, [self.access], 1))
        except CudaDriverError:
            cu.cuMemUnmap(address, size)
            cu.cuMemRelease(handle)
            raise
        return handle

    def unmap(self, address: int, size: int, handle: Any) -> None:
        check("cuMemUnmap", self.cu.cuMemUnmap(address, size))
        check("cuMemRelease", self.cu.cuMemRelease(handle))


def host_alloc_pinned(size: int) -> int:
    """Page-locked host memory of exactly `size` bytes (the caching host allocator would round
    up to a power of two)."""
    return int(check("cuMemHostAlloc", driver().cuMemHostAlloc(size, 0)))


def host_register(ptr: int, size: int) -> None:
    """Page-lock existing host memory [ptr, ptr + size) for the device's copies."""
    check("cuMemHostRegister", driver().cuMemHostRegister(ptr, size, 0))


def host_unregister(ptr: int) -> None:
    check("cuMemHostUnregister", driver().cuMemHostUnregister(ptr))


def host_free_pinned(ptr: int) -> None:
    check("cuMemFreeHost", driver().cuMemFreeHost(ptr))


def copy_d2h(dst: int, src: int, size: int, stream: int) -> None:
    check("cuMemcpyDtoHAsync", driver().cuMemcpyDtoHAsync(dst, src, size, stream))


def copy_h2d(dst: int, src: int, size: int, stream: int) -> None:
    check("cuMemcpyHtoDAsync", driver().cuMemcpyHtoDAsync(dst, src, size, stream))


def memset_zero(dst: int, size: int, stream: int) -> None:
    check("cuMemsetD8Async", driver().cuMemsetD8Async(dst, 0, size, stream))


def stream_synchronize(stream: int) -> None:
    check("cuStreamSynchronize", driver().cuStreamSynchronize(stream))


def event_create() -> Any:
    cu = driver()
    return check("cuEventCreate", cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))


def event_record(event: Any, stream: int) -> None:
    check("cuEventRecord", driver().cuEventRecord(event, stream))


def event_synchronize(event: Any) -> None:
    check("cuEventSynchronize", driver().cuEventSynchronize(event))


def event_destroy(event: Any) -> None:
    check("cuEventDestroy", driver().cuEventDestroy(event))


def stream_create() -> Any:
    """A non-blocking stream of the current context. Made through the driver because PyTorch's
    first extra stream creates its whole stream pool, which costs ~70 MiB of device memory."""
    cu = driver()
    return check("cuStreamCreate", cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))


def make_primary_context_current(device_index: int) -> None:
    """Make the device's primary context (the one PyTorch's runtime uses) current on this
    thread, creating it if PyTorch has not touched the device yet."""
    cu = driver()
    device = check("cuDeviceGet", cu.cuDeviceGet(device_index))
    context = check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(device))
    check("cuCtxSetCurrent", cu.cuCtxSetCurrent(context))


def pci_bus_id(device_index: int) -> str:
    """The device's PCI bus id, e.g. "0000:04:00.0" (the form NVML's nvmlDeviceGetHandleByPciBusId takes)."""
    cu = driver()
    device = check("cuDeviceGet", cu.cuDeviceGet(device_index))
    raw = check("cuDeviceGetPCIBusId", cu.cuDeviceGetPCIBusId(32, device))
    return raw.split(b"\0")[0].decode() if isinstance(raw, bytes) else str(raw).rstrip("\0")
