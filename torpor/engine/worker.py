"""`Worker`: one rank of an engine — its device state and everything done to it.

A Worker owns its tensor-parallel group (`TPGroup`), its `MemoryManager`, its `ModelRunner` (the model, the KV
cache, every device buffer) and its side of weight updates (`RankUpdates`: update groups, tensors waiting for
their copy). Every rank has one — rank 0 too, in the engine's process; ranks 1..N-1 in processes of their own
(executor/multiproc.py). The executor calls its methods by name with typed arguments (`collective_rpc`); each
method runs with the Worker's group active (distributed.py), so the layers' collectives reach this engine's
ranks and no other's. Worker extensions (`worker_extension_cls`) add methods to this class.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict

import torch

from torpor.engine.config import EngineConfig
from torpor.engine.distributed import TPGroup
from torpor.engine.model_runner import ModelRunner
from torpor.engine.sampler import SamplerOutput
from torpor.engine.sequence import Sequence
from torpor.engine.step_batch import StepBatch
from torpor.engine.weights.loader import read_weight
from torpor.engine.weights.transfer_info import IPCUpdateInfo, open_ipc
from torpor.engine.weights.updates import (
    EXTENSION,
    OPENED,
    TRANSFER,
    RankUpdates,
    release_transfer_memory,
    specs_of,
)
from torpor.memory import device_used_bytes


class Worker:
    """`memory`: this rank's MemoryManager (None: no sleep mode)."""

    # What `collective_rpc` offers from outside the engine (LLM.collective_rpc, POST /collective_rpc): the
    # readings below and a worker extension's own methods (`extension_methods`, set by executor.with_extension).
    # Every other method changes state the engine owns (the lifecycle, the weights, the memory) and is driven by
    # the engine's own operations, which keep their rules.
    RPC_READINGS = frozenset({"info", "weights_clean", "has_update_group", "is_context_checkpointed"})
    extension_methods: frozenset[str] = frozenset()

    def __init__(self, config: EngineConfig, group: TPGroup, memory=None) -> None:
        self.group, self.memory = group, memory
        with group.active():
            self.runner = ModelRunner(config, memory)
        self.config, self.device = self.runner.config, self.runner.device  # with the profiled KV blocks
        self.rank = group.rank
        self.updates = RankUpdates(self.device, group.rank, config.model)

    # ---- steps -------------------------------------------------------------------------------------
    def execute_model(self, seqs: list[Sequence], is_prefill: bool) -> SamplerOutput:
        """Rank 0: one scheduled batch, sampled."""
        with self.group.active():
            output = self.runner.run(seqs, is_prefill)
            self.group.check_exchange()
            return output

    def execute_batch(self, batch: StepBatch) -> None:
        """Ranks 1..N-1: the forward pass of rank 0's batch (rank 0 samples from the gathered logits)."""
        with self.group.active(), torch.inference_mode():
            self.runner.compute_logits(batch.sequences(), batch.is_prefill)
            self.group.check_exchange()

    # ---- memory ------------------------------------------------------------------------------------
    def sleep(self, actions: Mapping[str, str]):
        """This rank's part of a sleep: the exchange buffer first (every rank releases it whatever happens next:
        a failed sleep is rolled back by a wake on every rank, which maps it again everywhere), then the tags."""
        if actions:
            self.group.release_exchange()
        report = self.memory.sleep(actions)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the steps' cached temporaries (default pool) go back too
        return report

    def wake(self, tags: Iterable[str] | None):
        """This rank's part of a wake: the exchange buffer (a collective with the other ranks), then the tags."""
        self.group.restore_exchange()
        report = self.memory.wake(None if tags is None else list(tags))
        if tags is None or "weights" in tags:
            self.memory.mark_clean("weights")  # unwritten since the wake: the next level-1 sleep keeps the copy
        return report

    def check_sleep(self, actions: Mapping[str, str]) -> None:
        """Raise (touching nothing) if `sleep(actions)` is bound to fail for want of host memory."""
        self.memory.check_sleep(actions)

    def mark_weights_dirty(self) -> None:
        """Every path that writes the weights calls this first: the next level-1 sleep copies them again."""
        if self.memory is not None and "weights" in self.memory.tags():
            self.memory.mark_dirty("weights")

    def weights_clean(self) -> bool:
        """Whether the weights' host copy equals them: a failed write can then be undone (`revert_weights`)."""
        return self.memory is not None and self.memory.is_clean("weights")

    def snapshot_weights(self) -> int:
        """Copy the weights into their host copy (kept, marked clean) so that a write can be undone; bytes."""
        return self.memory.snapshot("weights")

    def revert_weights(self) -> int:
        """Copy the weights' clean host copy back over them (undo a failed write); bytes."""
        with self.group.active():
            return self.memory.revert("weights")

    def reserve_host_copies(self, tags: list[str]):
        """Start reserving the host copies a level-1 sleep needs, in the background (`MemoryManager`)."""
        return self.memory.reserve_host_in_background(tags, on_done=None)

    # ---- the CUDA context (levels 3 and 4; one GPU per process) --------------------------------------
    def check_checkpoint(self) -> None:
        self.memory.check_checkpoint()

    def checkpoint_context(self):
        return self.memory.checkpoint_context()

    def restore_context(self):
        return self.memory.restore_context()

    def is_context_checkpointed(self) -> bool:
        return self.memory.is_context_checkpointed()

    # ---- weights -----------------------------------------------------------------------------------
    def reload_weights(self, path: str) -> None:
        """The checkpoint at `path` into the existing parameters (every header checked first)."""
        self.mark_weights_dirty()
        with self.group.active():
            self.runner.reload_weights(path)

    def load_weights(self, named_tensors, strict: bool, reset_buffers: bool = True, staged: bool = False) -> int:
        """Hugging Face-named tensors into the existing parameters (`ModelRunner.update_weights`)."""
        self.mark_weights_dirty()
        with self.group.active():
            return self.runner.update_weights(named_tensors, strict, reset_buffers, staged)

    def check_update(self, named_tensors, strict: bool, staged: bool = False) -> None:
        with self.group.active():
            self.runner.check_update(named_tensors, strict, staged)

    def reset_buffers(self) -> None:
        """Recompute the buffers no checkpoint holds (the RoPE table), after the weights were discarded."""
        with self.group.active():
            self.runner.reset_buffers()

    def synchronize(self) -> None:
        """This rank's copies done (before a trainer may reuse the memory they read). One rank: its engine stream
        only (the whole device would also wait for the staging thread's stream: the next request's finite check);
        several: the device (the copies may also feed the group's collectives)."""
        stream = self.runner.engine_stream.stream
        if stream is not None and self.group.size == 1:
            stream.synchronize()
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- weight updates from a trainer (update groups, per-rank payloads) -----------------------------
    def init_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                          group_name: str, backend: str | None, timeout: float) -> None:
        self.updates.init_group(master_address, master_port, rank_offset, world_size, group_name, backend, timeout)

    def has_update_group(self, group_name: str) -> bool:
        return self.updates.has_group(group_name)

    def start_receive(self, group_name: str, names: list[str], dtypes: list, shapes: list,
                      timeout_s: float | None = None, packed_bytes: int | None = None) -> None:
        """Receive the trainer's broadcasts on a thread of this rank's own (`wait_receive` ends it); `packed_bytes`:
        vLLM's packed broadcast."""
        self.updates.start_receive(group_name, specs_of(names, dtypes, shapes), timeout_s, packed_bytes)

    def wait_receive(self, group_name: str, timeout_s: float, waited_s: float | None = None) -> int:
        return self.updates.wait_receive(group_name, timeout_s, waited_s)

    def receive_done(self, group_name: str) -> bool:
        return self.updates.receive_done(group_name)

    def open_payload(self, serialized: list[str], load_format: str | None) -> list[str]:
        return self.updates.open_payload(serialized, load_format)

    def apply_staged(self, key: str = OPENED) -> int:
        """Copy what was received (or opened) under `key` into the weights: a partial set (buckets); the engine
        recomputes the RoPE table once the set is whole."""
        tensors = self.updates.take(key)
        try:
            count = self.load_weights(tensors, strict=False, reset_buffers=False)
            self.synchronize()  # before the trainer's memory is released
            return count
        finally:
            release_transfer_memory(tensors)

    # ---- what a worker extension writes ----------------------------------------------------------------
    def write_weights(self, named_tensors) -> list[str]:
        """The weights a worker extension received, for the engine to write: an extension method calls this where
        vLLM's calls `self.model_runner.model.load_weights(weights=...)`. The Hugging Face-named tensors are checked
        against the checkpoint (names, shapes, dtypes) and kept on this rank; once the `collective_rpc` call returns
        on every rank, the engine writes what every rank kept through its WeightReceiver, as one update (with the
        other tensors of a four-phase update in progress, if one is: served only after finish_weight_update), or
        nothing if any rank failed or the ranks disagree. The tensors must stay valid until the call returns
        (fresh ones, or the trainer's memory it keeps alive). Returns the names kept so far in this call."""
        return self.updates.stage(EXTENSION, [(name, tensor) for name, tensor in named_tensors], extend=True)

    def staged_names(self, key: str) -> list[str]:
        return self.updates.staged_names(key)

    # ---- vLLM's four-phase update (weights/transfer.py) -----------------------------------------------
    def open_transfer(self, info: IPCUpdateInfo) -> list[str]:
        """This rank's tensors of an IPC chunk opened (its GPU's handles, or shared memory on CPU), checked, and
        kept for the copy (`apply_staged(TRANSFER)`); the names."""
        pairs = open_ipc(info, self.device, self.updates.manifest.max_bytes)
        return self.updates.stage(TRANSFER, pairs)

    def read_weight(self, name: str, shape: list[int]) -> list:
        """What this rank holds of the checkpoint tensor `name` (SGLang's get_weights_by_name): (shape, stride,
        offset) of each piece in the full tensor, with the piece's values (float32, on the host)."""
        with self.group.active():
            return read_weight(self.runner.model, name, tuple(shape))

    def drop_staged(self, key: str = OPENED, destroy_group: bool = False) -> None:
        self.updates.drop(key, destroy_group)

    def destroy_update_group(self, group_name: str) -> bool:
        return self.updates.destroy_group(group_name)

    # ---- readings and the end -------------------------------------------------------------------------
    def info(self) -> dict:
        """This rank's device, its memory in use (the whole device; CPU: the process's RSS), its tags and how
        many CUDA graphs it holds."""
        if self.memory is not None:
            used, tags = self.memory.device_used_bytes(), {t: asdict(u) for t, u in self.memory.usage().items()}
        else:
            used, tags = device_used_bytes(self.device), {}
        graphs = self.runner.graphs.graphs if self.runner.graphs is not None else {}
        return {"rank": self.rank, "pid": os.getpid(), "device": str(self.device), "device_used_bytes": used,
                "cuda_graphs": len(graphs), "tags": tags}

    def close(self) -> None:
        """Free the graphs (they captured the group's collectives) and the GEMM workspace, and leave every update
        group; the engine's TP group is left by the executor."""
        self.updates.close()
        self.runner.close()
