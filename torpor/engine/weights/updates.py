"""One rank's side of weight updates from a trainer: its update groups (standalone process groups to the trainer,
transport.py) and the tensors it received or opened that wait for their copy, keyed by group name (or
`OPENED` for a payload of update_weights_from_tensor). A `Worker` owns one `RankUpdates`; nothing here is
process-global, so every engine (and every rank) has its own.

Receiving and copying are separate steps: an update is received (or opened and checked) on every rank first, and
copied on every rank only once every rank holds its part, so a failure on any rank writes nothing anywhere. A
receive may run on a thread of its own (`start_receive`) while the engine keeps serving on the old weights.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence

import torch

from torpor.engine.weights.manifest import Manifest
from torpor.engine.weights.payload import named_tensors_of, parse_dtype, unpickle_payload
from torpor.engine.weights.transfer_info import packed_groups, unpack
from torpor.engine.weights.transport import (
    UpdateGroup,
    WeightTransferError,
    destroy_group_handle,
    open_update_group,
    receive_tensors,
)

OPENED = "\0opened"  # the key of a per-rank payload (no group name can hold a NUL)
TRANSFER = "\0transfer"  # the key of a chunk of vLLM's four-phase IPC update
EXTENSION = "\0extension"  # the key of what a worker extension gave `Worker.write_weights`


def release_transfer_memory(named_tensors: list) -> None:
    """Drop the references to the trainer's memory (IPC mappings, shared-memory files) and, on CUDA, let torch
    close the IPC handles now (`ipc_collect`)."""
    named_tensors.clear()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()


def specs_of(names, dtypes, shapes) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor of a distributed update, checked."""
    if not all(isinstance(v, list | tuple) for v in (names, dtypes, shapes)) or \
            not len(names) == len(dtypes) == len(shapes) or not names:
        raise ValueError("names, dtypes and shapes must be non-empty lists of the same length")
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if not isinstance(name, str):
            raise ValueError(f"names must be strings, got {name!r}")
        if not isinstance(shape, list | tuple) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"shape of {name!r} must be a list of non-negative ints, got {shape!r}")
        specs.append((name, parse_dtype(dtype, f"dtype of {name!r}"), tuple(shape)))
    return specs


class RankUpdates:
    """`device`: the rank's; `rank`: its rank in its engine's tensor-parallel group; `checkpoint`: the engine's
    checkpoint folder (its manifest is read on first use)."""

    def __init__(self, device: torch.device, rank: int, checkpoint: str) -> None:
        self.device, self.rank, self.checkpoint = device, rank, checkpoint
        self._groups: dict[str, UpdateGroup | None] = {}  # None: reserved while it forms
        self._staged: dict[str, list[tuple[str, torch.Tensor]]] = {}
        self._receiving: dict[str, threading.Thread] = {}
        self._errors: dict[str, BaseException] = {}
        self._lock = threading.Lock()  # a server joins groups off the engine thread
        self._manifest: Manifest | None = None

    @property
    def manifest(self) -> Manifest:
        if self._manifest is None:
            self._manifest = Manifest.of_checkpoint(self.checkpoint)
        return self._manifest

    # ---- groups ----------------------------------------------------------------------------------
    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str | None, timeout: float) -> None:
        """Join `group_name` as rank `rank_offset + rank` (the trainer is rank 0)."""
        with self._lock:
            if group_name in self._groups:
                raise ValueError(f"weights update group {group_name!r} exists already; destroy it first")
            self._groups[group_name] = None  # a second init of it fails at once instead of replacing the first
        try:
            group = open_update_group(master_address, master_port, rank_offset + self.rank, world_size, group_name,
                                      backend, self.device, timeout)
        except BaseException:
            with self._lock:
                self._groups.pop(group_name, None)
            raise
        with self._lock:
            self._groups[group_name] = group

    def has_group(self, group_name: str) -> bool:
        with self._lock:
            return self._groups.get(group_name) is not None

    def group(self, group_name: str) -> UpdateGroup:
        with self._lock:
            if group_name in self._groups and self._groups[group_name] is None:
                raise ValueError(f"weights update group {group_name!r} is still forming (init_weights_update_group)")
            group = self._groups.get(group_name)
        if group is None:
            raise ValueError(f"no weights update group {group_name!r}: call init_weights_update_group first")
        return group

    def destroy_group(self, group_name: str) -> bool:
        """Forget the group (its communicator goes with it) and what it received; whether it existed (one still
        forming is left to its init)."""
        with self._lock:
            group = self._groups.pop(group_name) if self._groups.get(group_name) is not None else None
            staged = self._staged.pop(group_name, None)
        if staged is not None:
            release_transfer_memory(staged)
        if group is None:
            return False
        destroy_group_handle(group)
        return True

    def close(self) -> None:
        """Every group of this rank (its engine closes): their sockets and threads go now."""
        with self._lock:
            names = [name for name, group in self._groups.items() if group is not None]
        for name in names:
            self.destroy_group(name)
        for key in list(self._staged):
            self.drop(key)

    # ---- receiving -------------------------------------------------------------------------------
    def receive(self, group_name: str, specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
                deadline: float | None = None, packed_bytes: int | None = None) -> int:
        """The trainer's broadcasts of `specs` (in order) into fresh tensors on this rank's device by `deadline`
        (transport.receive_tensors: any size mismatch, a trainer gone or silent is a WeightTransferError and the group
        is destroyed), staged under `group_name`. `packed_bytes`: vLLM's packed broadcast instead, uint8 buffers of
        consecutive tensors closed past that many bytes (`packed_groups`). Nothing is written to the model here."""
        group = self.group(group_name)
        try:
            received = receive_tensors(group, specs, deadline) if packed_bytes is None else \
                _receive_packed(group, specs, packed_bytes, deadline)
        except WeightTransferError:
            with self._lock:  # its handle is destroyed already: forget it
                if self._groups.get(group_name) is group:
                    del self._groups[group_name]
            raise
        with self._lock:
            self._staged[group_name] = received
        return len(received)

    def start_receive(self, group_name: str, specs, timeout_s: float | None = None,
                      packed_bytes: int | None = None) -> None:
        """`receive` on a thread of its own, for at most `timeout_s` (default: the group's timeout): the engine goes
        on serving meanwhile (`wait_receive` ends it)."""
        group = self.group(group_name)  # a missing group is refused now
        deadline = time.monotonic() + (group.timeout_s if timeout_s is None else timeout_s)
        if group_name in self._receiving:
            raise ValueError(f"weights update group {group_name!r} is receiving already")

        def run() -> None:
            try:
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)
                self.receive(group_name, specs, deadline, packed_bytes)
            except BaseException as e:  # handed to wait_receive
                self._errors[group_name] = e

        thread = threading.Thread(target=run, name=f"torpor-weights-receive-{group_name}", daemon=True)
        self._receiving[group_name] = thread
        thread.start()

    def receive_done(self, group_name: str) -> bool:
        """Whether `start_receive`'s thread has ended (its error, if any, is raised now)."""
        thread = self._receiving.get(group_name)
        if thread is None:
            raise ValueError(f"weights update group {group_name!r} is not receiving")
        if thread.is_alive():
            return False
        self.wait_receive(group_name, 0.0)
        return True

    def wait_receive(self, group_name: str, timeout_s: float, waited_s: float | None = None) -> int:
        """Wait (at most `timeout_s`) for `start_receive`'s tensors; their count. A receive still running at the
        deadline destroys the group (its collective then ends) and raises WeightTransferError (saying it waited
        `waited_s`, default `timeout_s`: a caller that polled `receive_done` waits 0 at its deadline)."""
        thread = self._receiving.get(group_name)
        if thread is None:
            raise ValueError(f"weights update group {group_name!r} is not receiving")
        thread.join(timeout_s)
        if thread.is_alive():  # the receive ends at its own deadline (a gloo broadcast waits out its timeout)
            self.destroy_group(group_name)
            self._receiving.pop(group_name, None)
            self._errors.pop(group_name, None)
            waited = timeout_s if waited_s is None else waited_s
            raise WeightTransferError(f"weights update group {group_name!r}: the trainer's broadcasts did not arrive "
                                      f"within {waited:g} s; nothing was written, the previous weights stay; the "
                                      "group is destroyed")
        self._receiving.pop(group_name)
        error = self._errors.pop(group_name, None)
        if error is not None:
            raise error
        return len(self._staged.get(group_name, ()))

    # ---- payloads and the copy -------------------------------------------------------------------
    def open_payload(self, serialized: Sequence[str], load_format: str | None) -> list[str]:
        """This rank's entry of a per-rank update_weights_from_tensor, opened and checked against the manifest,
        staged under OPENED; the names it holds."""
        pairs = named_tensors_of(unpickle_payload(serialized[self.rank], self.manifest.max_bytes), load_format)
        try:
            self.manifest.check(pairs)
        except BaseException:
            release_transfer_memory(pairs)
            raise
        with self._lock:
            self._staged[OPENED] = pairs
        return [name for name, _ in pairs]

    def stage(self, key: str, pairs: list[tuple[str, torch.Tensor]], extend: bool = False) -> list[str]:
        """Checked tensors (against the manifest) staged under `key` for a copy to come (`extend`: added to what is
        staged there already, each name once); the names staged there now."""
        with self._lock:
            before = list(self._staged.get(key, ())) if extend else []
        try:
            self.manifest.check(before + list(pairs))
        except BaseException:
            release_transfer_memory(pairs)
            raise
        with self._lock:
            self._staged[key] = before + list(pairs)
            return [name for name, _ in self._staged[key]]

    def staged_names(self, key: str) -> list[str]:
        with self._lock:
            return [name for name, _ in self._staged.get(key, ())]

    def take(self, key: str) -> list[tuple[str, torch.Tensor]]:
        """The staged tensors of `key` (the caller copies, then releases them)."""
        with self._lock:
            staged = self._staged.pop(key, None)
        if staged is None:
            raise ValueError(f"nothing was received for {key!r}")
        return staged

    def drop(self, key: str, destroy: bool = False) -> None:
        """A failed or refused update: its staged tensors go (and with `destroy` the group, out of step)."""
        with self._lock:
            staged = self._staged.pop(key, None)
        if staged is not None:
            release_transfer_memory(staged)
        if destroy:
            self.destroy_group(key)


def _receive_packed(group: UpdateGroup, specs, packed_bytes: int, deadline: float | None):
    """vLLM's packed broadcast: one uint8 buffer per group of consecutive tensors, each received and checked as one
    tensor (receive_tensors), then viewed as its tensors (fresh memory of this rank: nothing aliases the trainer)."""
    groups = packed_groups(specs, packed_bytes)
    buffers = receive_tensors(group, [(f"packed buffer {i} ({len(g)} tensors from {g[0][0]!r})", torch.uint8,
                                       (sum(math.prod(s) * d.itemsize for _, d, s in g),))
                                      for i, g in enumerate(groups)], deadline)
    return [pair for members, (_, buffer) in zip(groups, buffers, strict=True) for pair in unpack(buffer, members)]
