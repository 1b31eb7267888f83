"""Probe: which first-time step of a sleep costs device memory (printed as used MiB)."""
import torch

from torpor.memory import cuda_driver


def used() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


torch.zeros(1, device="cuda")
torch.cuda.synchronize()
print(f"context            {used():8.0f}")
s = torch.cuda.Stream()
print(f"+ stream           {used():8.0f}")
ptr = cuda_driver.host_alloc_pinned(1 << 20)
print(f"+ pinned 1 MiB     {used():8.0f}")
d = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
cuda_driver.copy_d2h(ptr, d.data_ptr(), 1 << 20, s.cuda_stream)
cuda_driver.stream_synchronize(s.cuda_stream)
print(f"+ d2h copy         {used():8.0f}")
ev = cuda_driver.event_create()
cuda_driver.event_record(ev, s.cuda_stream)
cuda_driver.event_synchronize(ev)
print(f"+ event            {used():8.0f}")
big = cuda_driver.host_alloc_pinned(1 << 30)
print(f"+ pinned 1 GiB     {used():8.0f}")
from torpor.memory.cuda_driver import VirtualMemory  # noqa: E402

vm = VirtualMemory(0)
va = vm.reserve(64 << 20)
h = vm.map(va, 64 << 20)
print(f"+ vmm map 64 MiB   {used():8.0f}")
vm.unmap(va, 64 << 20, h)
print(f"- vmm unmap        {used():8.0f}")
