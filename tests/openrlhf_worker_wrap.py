"""A worker extension in the shape of OpenRLHF's `WorkerWrap` (openrlhf/trainer/ray/vllm_worker_wrap.py), for
torpor's `worker_extension_cls`: the same methods and arguments, the same torch calls for the group (SGLang's
`init_custom_process_group`, as OpenRLHF's own `init_process_group` makes it) and the broadcast; what differs is
torpor's Worker: its rank is `self.rank` (vLLM: `torch.distributed.get_rank()`), its dtype `self.runner.dtype`, and
the weights are written by `self.write_weights(...)` (vLLM: `self.model_runner.model.load_weights(weights=...)`),
which keeps the engine's rule (checked whole, written by the engine once the call returned on every rank)."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sglang_trainer import trainer_group  # the tests folder (a worker process imports this file by name)


class WorkerWrap:
    def init_process_group(self, master_address, master_port, rank_offset, world_size, group_name, backend="nccl",
                           use_ray=False):
        """Init torch process group for model weights update."""
        assert group_name != "", "group name must not be empty"
        if use_ray:
            raise ValueError("use_ray: a ray.util.collective group is not used here")
        rank = self.rank + rank_offset
        self._model_update_group = trainer_group(int(master_port), world_size, group_name, timeout_s=60,
                                                 backend=backend, address=master_address, rank=rank)
        self._model_update_with_ray = use_ray

    def update_weight(self, name, dtype, shape, empty_cache=False):
        """Broadcast weight to all workers from source rank 0 (the trainer)."""
        dtype = getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
        weight = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(weight, 0, group=self._model_update_group)
        self.write_weights([(name, weight)])
        del weight

    def destroy_process_group(self) -> None:
        """Leave the group (before the engine closes: its sockets go now, not at the interpreter's exit)."""
        group, self._model_update_group = self._model_update_group, None
        if group is not None:
            dist.destroy_process_group(group)

    def report(self, prefix: str = "rank") -> str:
        """A string (collective_rpc over HTTP answers it as is)."""
        return f"{prefix} {self.rank} of {self.group.size}"

    def describe(self) -> dict:
        return {"rank": self.rank, "device": str(self.device)}

    def counted(self) -> int:
        return self.rank + 41  # an int: answered str()-ed over HTTP, as vLLM does
