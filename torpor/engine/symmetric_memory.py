"""`SymmetricMemory`: one slot of device memory per tensor-parallel rank, mapped by every rank at the same
offsets of one reserved address range (slot r is rank r's own memory; peers reach it over NVLink).

The memory is CUDA virtual memory made shareable as a POSIX file descriptor. The descriptors travel
between the ranks over abstract Unix sockets (SCM_RIGHTS; only to processes of the same user) whose names
carry the group's key and a generation, so every `map()` is a fresh exchange. `unmap()` releases every
mapping and handle (a slot's memory goes back to its device once every rank released it); `map()` creates
and maps new memory at the same addresses, zero-filled, and returns once every rank has done so, so kernels
captured in CUDA graphs on these addresses stay valid across a sleep. Every rank ends a `map()` in the same
agreement, failed or not: a rank that could not map its part says so there, and every rank then releases
what it mapped and raises, at once (a barrier would keep the others waiting until the group's timeout).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from typing import Any

import torch

from torpor.memory.cuda_driver import check, driver, make_primary_context_current


class SymmetricMemory:
    def __init__(self, rank: int, size: int, device: torch.device, group_key: str, agree,
                 slot_bytes: int = 8 << 20, timeout_s: float = 60.0) -> None:
        """`agree(ok) -> bool`: a collective of every rank, True if every rank passed ok=True (the process
        group's, `distributed.all_ranks_ok`). Maps the memory (a collective)."""
        cu = driver()
        make_primary_context_current(device.index)  # under gloo nothing may have touched the device yet
        self.cu, self.rank, self.size, self.device = cu, rank, size, device
        self.group_key, self.agree, self.timeout_s = group_key, agree, timeout_s
        fd_type = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.fd_type = fd_type
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device.index
        prop.requestedHandleTypes = fd_type
        self.prop = prop
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device.index
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access = access
        flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        granularity = int(check("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(prop, flag)))
        self.slot_bytes = -(-slot_bytes // granularity) * granularity
        self.base = int(check("cuMemAddressReserve",
                              cu.cuMemAddressReserve(self.size * self.slot_bytes, granularity, 0, 0)))
        self._handles: list[Any] = []
        self._generation = 0
        interface = {"shape": (self.size * self.slot_bytes,), "typestr": "|u1", "data": (self.base, False),
                     "version": 3}
        self._bytes = torch.as_tensor(_CudaArray(interface), device=device)  # does not own the memory
        try:
            self.map()
        except BaseException:  # map released what it had mapped; the address range goes too
            self.close()
            raise

    @property
    def is_mapped(self) -> bool:
        return bool(self._handles)

    def view(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole range as a tensor of `dtype` (no copy; valid while mapped)."""
        return self._bytes.view(dtype)

    def map(self) -> None:
        """New memory for this rank's slot, every peer's slot mapped: a collective (every rank calls it). It
        raises on every rank if any rank failed (each releases what it had mapped)."""
        if self.is_mapped:
            return
        try:
            self._map_slots()
        except Exception:  # the others must hear of it now, not at the group's timeout
            with contextlib.suppress(Exception):  # (a peer gone too: this rank's own error says more)
                self.agree(False)
            raise
        try:  # every slot is zeroed before any rank's kernel reads a peer's flags
            everyone_mapped = self.agree(True)
        except BaseException:
            self._release({})
            raise
        if not everyone_mapped:
            self._release({})
            raise RuntimeError("another tensor-parallel rank failed to map its part of the exchange buffer "
                               "(its own error says why)")

    def _map_slots(self) -> None:
        """This rank's part of `map`: its slot created, exported and zeroed, every peer's imported, all mapped
        (on failure, what was made is released)."""
        make_primary_context_current(self.device.index)
        cu, self._generation = self.cu, self._generation + 1
        own = check("cuMemCreate", cu.cuMemCreate(self.slot_bytes, self.prop, 0))
        handles = {self.rank: own}
        try:
            fd = int(check("cuMemExportToShareableHandle", cu.cuMemExportToShareableHandle(own, self.fd_type, 0)))
            try:
                peer_fds = self._exchange(fd)
            finally:
                os.close(fd)
            for peer, peer_fd in peer_fds.items():
                try:
                    handles[peer] = check("cuMemImportFromShareableHandle",
                                          cu.cuMemImportFromShareableHandle(peer_fd, self.fd_type))
                finally:
                    os.close(peer_fd)
            for r in range(self.size):
                check("cuMemMap", cu.cuMemMap(self.base + r * self.slot_bytes, self.slot_bytes, 0, handles[r], 0))
                self._handles.append((r, handles.pop(r)))
            check("cuMemSetAccess", cu.cuMemSetAccess(self.base, self.size * self.slot_bytes, [self.access], 1))
            own_slot = self.base + self.rank * self.slot_bytes
            check("cuMemsetD8", cu.cuMemsetD8(own_slot, 0, self.slot_bytes))
            check("cuCtxSynchronize", cu.cuCtxSynchronize())
        except BaseException:
            self._release(handles)
            raise

    def unmap(self) -> None:
        """Release every mapping and handle (the device must be idle: call after a synchronize)."""
        if self.is_mapped:
            make_primary_context_current(self.device.index)  # the calling thread may have none current
            check("cuCtxSynchronize", self.cu.cuCtxSynchronize())
            self._release({})

    def close(self) -> None:
        self.unmap()
        with contextlib.suppress(Exception):
            self.cu.cuMemAddressFree(self.base, self.size * self.slot_bytes)

    def _release(self, unmapped: dict) -> None:
        for r, handle in self._handles:
            self.cu.cuMemUnmap(self.base + r * self.slot_bytes, self.slot_bytes)
            self.cu.cuMemRelease(handle)
        for handle in unmapped.values():
            self.cu.cuMemRelease(handle)
        self._handles = []

    # ---- descriptors between the ranks -------------------------------------------------------------
    def _socket_name(self, rank: int) -> bytes:
        return f"\0torpor-symmetric-{self.group_key}-{self._generation}-{rank}".encode()

    def _exchange(self, fd: int) -> dict[int, int]:
        """Hand `fd` to every peer and receive theirs: {peer rank: its descriptor}."""
        deadline = time.monotonic() + self.timeout_s
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(self._socket_name(self.rank))
        server.listen(self.size)
        errors: list[BaseException] = []
        serving = threading.Thread(target=self._serve, args=(server, fd, deadline, errors), daemon=True)
        serving.start()
        try:
            received = {peer: self._receive(peer, deadline) for peer in range(self.size) if peer != self.rank}
        finally:
            serving.join(max(0.0, deadline - time.monotonic()))
            server.close()
        if errors or serving.is_alive():
            for peer_fd in received.values():
                os.close(peer_fd)
            raise errors[0] if errors else TimeoutError("a tensor-parallel peer did not fetch this rank's memory")
        return received

    def _serve(self, server: socket.socket, fd: int, deadline: float, errors: list) -> None:
        try:
            served = 0
            while served < self.size - 1:  # a connection of another user is turned away without using a turn
                server.settimeout(max(0.001, deadline - time.monotonic()))
                conn, _ = server.accept()
                with conn:
                    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                    struct.calcsize("3i")))
                    if uid != os.getuid():
                        continue  # only the engine's own ranks (same user) get the descriptor
                    socket.send_fds(conn, [struct.pack("i", self.rank)], [fd])
                    served += 1
        except BaseException as e:
            errors.append(e)

    def _receive(self, peer: int, deadline: float) -> int:
        while True:
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                client.settimeout(max(0.001, deadline - time.monotonic()))
                client.connect(self._socket_name(peer))
                _, fds, _, _ = socket.recv_fds(client, 4, 1)
                if len(fds) != 1:
                    raise RuntimeError(f"tensor-parallel rank {peer} sent no memory descriptor")
                return fds[0]
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tensor-parallel rank {peer} did not share its memory within "
                                       f"{self.timeout_s:.0f} s") from None
                time.sleep(0.002)  # the peer has not bound its socket yet
            finally:
                client.close()



class _CudaArray:
    def __init__(self, interface: dict) -> None:
        self.__cuda_array_interface__ = interface
