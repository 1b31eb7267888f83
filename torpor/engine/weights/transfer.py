"""vLLM's native weight transfer on the engine (rank 0): the four phases, their order and their rule.

    init_weight_transfer_engine({"init_info": ...})   once: the backend's channel to the trainer (nccl: its group)
    start_weight_update()                              one update begins: nothing runs until it ends
    update_weights({"update_info": ...})               a chunk, any number of times: received, checked, copied
    finish_weight_update(weight_version=None)          the update commits: the new weights serve, labelled

The update is one `WeightReceiver` update (receiver.py): each chunk is written as a request of it, so no step ever
sees part of it; a chunk that fails (refused, or the trainer gone) ends it as a failure, and so does a sleep or (on
the server) `push_idle_timeout_s` without a call: the old weights come back from their host copy when it was current
at the start, else the engine does not serve until a complete update or a reload. Never a mix.

Backends (`EngineConfig.weight_transfer_config`): "ipc", the trainer's tensors by reference (transfer_info.py), and
"nccl", a process group to the trainer formed by transport.py (torch's `tcp://` rendezvous: the trainer, rank 0,
hosts a TCPStore there, as vLLM's StatelessProcessGroup does; engine rank r is `rank_offset + r`), over which the
trainer broadcasts each tensor (or vLLM's packed uint8 buffers) while `update_weights` is pending: NCCL on CUDA,
gloo on CPU.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from torpor.engine.config import WeightTransferConfig
from torpor.engine.executor.base import Executor
from torpor.engine.lifecycle import LifecycleError
from torpor.engine.weights.receiver import PushPosition, WeightReceiver
from torpor.engine.weights.transfer_info import (
    TRANSFER_GROUP,
    IPCUpdateInfo,
    NCCLInitInfo,
    NCCLUpdateInfo,
    parse,
)
from torpor.engine.weights.updates import TRANSFER

NOT_CONFIGURED = ("weight transfer is not configured: start the engine with weight_transfer_config={'backend': "
                  "'ipc' | 'nccl'} (torpor serve --weight-transfer-config '{\"backend\": \"nccl\"}')")


@dataclass(frozen=True)
class Chunk:
    """One `update_weights` call, parsed: its info and its place in the update."""

    info: NCCLUpdateInfo | IPCUpdateInfo
    push: PushPosition

    @property
    def names(self) -> list[str]:
        return list(self.info.names)


def request_field(request, name: str) -> dict:
    """vLLM's request forms: a dict `{name: {...}}` or an object with the attribute (WeightTransferInitRequest,
    WeightTransferUpdateRequest)."""
    value = request.get(name) if isinstance(request, dict) else getattr(request, name, None)
    if value is None:
        raise ValueError(f"missing {name!r}: pass {{{name!r}: {{...}}}}")
    if isinstance(request, dict) and set(request) - {name}:
        raise ValueError(f"unknown field(s) {sorted(set(request) - {name})} beside {name!r}")
    return value


class WeightTransfer:
    """The four phases of one engine (rank 0). `init` is the backend's (nccl: the group, which every rank joins);
    the update in progress is the receiver's, begun by `start` under an id of its own, its chunks counted here."""

    def __init__(self, config: WeightTransferConfig | None, receiver: WeightReceiver, executor: Executor) -> None:
        self.config, self.receiver, self.executor = config, receiver, executor
        self.init_info: NCCLInitInfo | None = None
        self.update_id: str | None = None
        self._chunks = 0

    @property
    def backend(self) -> str:
        if self.config is None:
            raise ValueError(NOT_CONFIGURED)
        return self.config.backend

    # ---- init -----------------------------------------------------------------------------------
    def init(self, init_info: dict) -> None:
        """ipc: `{}` (nothing to set up). nccl: every rank joins the trainer's group (a rank that fails makes every
        rank leave); once: again only after the group was given up (a failed update destroys it)."""
        if self.backend == "ipc":
            parse(_IPCInitInfo, init_info, "init_info")
            return
        if isinstance(init_info, dict) and "nccl_unique_id_b64" in init_info:
            raise ValueError("init_info.nccl_unique_id_b64 is not supported: torpor's group forms on the trainer's "
                             "TCP store (master_address, master_port, rank_offset, world_size)")
        info = parse(NCCLInitInfo, init_info, "init_info")
        if self.executor.driver.has_update_group(TRANSFER_GROUP):
            raise ValueError("init_weight_transfer_engine was called already: its group to the trainer is up (it is "
                             "called once; after a failed update gives the group up, call it again)")
        self.receiver.init_group(info.master_address, info.master_port, info.rank_offset, info.world_size,
                                 TRANSFER_GROUP, None, info.timeout)
        self.init_info = info

    # ---- start ----------------------------------------------------------------------------------
    def start(self, include_draft: bool = False, is_checkpoint_format: bool = True) -> None:
        """Begin one update. vLLM's variants' options: `include_draft` (a speculative-decoding draft model: torpor
        has none, refused) and `is_checkpoint_format` (TRL's; true: the checkpoint's names and layout, which is what
        torpor takes; false, kernel-format weights, refused)."""
        if include_draft is not False:
            raise ValueError("start_weight_update: include_draft is not supported (this engine has no draft model)")
        if is_checkpoint_format is not True:
            raise ValueError("start_weight_update: is_checkpoint_format must be true: the engine takes weights by "
                             "their checkpoint (Hugging Face) names and shapes")
        if self.backend == "nccl" and not self.executor.driver.has_update_group(TRANSFER_GROUP):
            raise LifecycleError("start_weight_update: the nccl backend's group is not up: call "
                                 "init_weight_transfer_engine first" + self._given_up())
        if self.update_id is not None and self.receiver.in_progress(self.update_id):
            raise LifecycleError("start_weight_update: a weight update is in progress already; finish it first")
        update_id = f"weight-transfer-{uuid.uuid4().hex[:12]}"
        self.receiver.begin(update_id, "start_weight_update")
        self.update_id, self._chunks = update_id, 0

    def _given_up(self) -> str:
        return " (the last update's failure gave it up)" if self.init_info is not None else ""

    # ---- update -----------------------------------------------------------------------------------
    def chunk(self, update_info: dict) -> Chunk:
        """The next chunk of the update in progress, parsed. Anything refused here ends the update (a trainer out
        of step with the engine: nccl's broadcasts of it have no receiver)."""
        update_id = self._current("update_weights")
        try:
            if self.backend == "ipc":
                info = parse(IPCUpdateInfo, update_info, "update_info")
            else:
                info = parse(NCCLUpdateInfo, update_info, "update_info")
                if not self.executor.driver.has_update_group(TRANSFER_GROUP):
                    raise LifecycleError("update_weights: the nccl backend's group was given up; call "
                                         "init_weight_transfer_engine again, then start a new update")
        except BaseException as exc:
            self.fail(f"update_weights refused: {exc}")
            raise
        self._chunks += 1
        return Chunk(info, PushPosition(update_id, self._chunks))

    def packed_bytes(self, info: NCCLUpdateInfo) -> int | None:
        """The packed buffer size of an nccl chunk (its own, else the init's), None when not packed."""
        init = self.init_info
        packed = info.packed if info.packed is not None else init is not None and init.packed
        if not packed:
            return None
        return info.packed_buffer_size_bytes or (init.packed_buffer_size_bytes if init is not None else 1 << 30)

    @property
    def timeout_s(self) -> float:
        """How long an nccl chunk's broadcasts may take (the init's `timeout`)."""
        return self.init_info.timeout if self.init_info is not None else 120.0

    def apply_ipc(self, chunk: Chunk) -> int:
        """An ipc chunk: every rank opens its handles and checks them, then every rank copies."""
        try:
            try:
                names = self.executor.collective_rpc("open_transfer", (chunk.info,))[0]
            except BaseException:
                self.executor.collective_rpc("drop_staged", (TRANSFER,))
                raise
            return self.receiver.apply_opened(names, TRANSFER, chunk.push, flush_cache=False)
        except BaseException as exc:
            self.fail(f"update_weights failed: {type(exc).__name__}: {exc}")
            raise

    def start_nccl(self, chunk: Chunk) -> None:
        """An nccl chunk's receive starts on every rank (threads of their own) while the trainer broadcasts."""
        info = chunk.info
        try:
            self.receiver.start_receive(info.names, info.dtype_names, info.shapes, TRANSFER_GROUP, self.timeout_s,
                                        self.packed_bytes(info))
        except BaseException as exc:
            self.fail(f"update_weights refused: {exc}")
            raise

    def nccl_done(self) -> bool:
        """Whether every rank's receive of the nccl chunk ended (its error, if any, raised: the update fails)."""
        try:
            return self.receiver.receive_done(TRANSFER_GROUP)
        except BaseException as exc:
            self.fail(f"update_weights failed: {type(exc).__name__}: {exc}")
            raise

    def give_up_nccl(self) -> None:
        """The chunk's receive ran past its deadline: the group is given up, the update fails (raises)."""
        try:
            self.receiver.wait_receive(TRANSFER_GROUP, 0.0, self.timeout_s)
        except BaseException as exc:
            self.fail(f"update_weights failed: {type(exc).__name__}: {exc}")
            raise

    def finish_nccl(self, chunk: Chunk, waited: bool = False) -> int:
        """An nccl chunk's receive ended on every rank (the caller polled `receiver.receive_done`, or with `waited`
        False, this waits for it): its tensors are copied as part of the update."""
        try:
            if not waited:
                self.receiver.wait_receive(TRANSFER_GROUP, self.timeout_s + 5.0, self.timeout_s)
            return self.receiver.apply_received(chunk.names, TRANSFER_GROUP, False, chunk.push)
        except BaseException as exc:
            self.fail(f"update_weights failed: {type(exc).__name__}: {exc}")
            raise

    def update(self, update_info: dict) -> int:
        """A whole chunk, blocking (LLM): received or opened, checked, copied. The count of tensors written."""
        chunk = self.chunk(update_info)
        if self.backend == "ipc":
            return self.apply_ipc(chunk)
        self.start_nccl(chunk)
        return self.finish_nccl(chunk)

    def next_push(self) -> PushPosition | None:
        """The place of another write in the update in progress (a worker extension's), None without one."""
        if self.update_id is None or not self.receiver.in_progress(self.update_id):
            return None
        self._chunks += 1
        return PushPosition(self.update_id, self._chunks)

    # ---- finish and failure ---------------------------------------------------------------------------
    def finish(self, weight_version: str | None = None) -> None:
        """The update commits; `weight_version` labels the weights (set with the commit: never on a failure)."""
        update_id = self._current("finish_weight_update")
        self.receiver.commit(update_id, weight_version)
        self.update_id = None

    def fail(self, reason: str) -> bool:
        """End the update in progress as a failure (whatever it wrote is undone or marked); whether one was. Its id
        stays, so the next call of it says why it ended."""
        return self.update_id is not None and self.receiver.abandon(self.update_id, reason)

    def abandon(self, update_id: str, reason: str) -> bool:
        """The server's idle timeout: end `update_id` as a failure if it is still the one in progress."""
        if self.update_id != update_id:
            return False
        return self.fail(reason)

    def _current(self, what: str) -> str:
        if self.update_id is None or not self.receiver.in_progress(self.update_id):
            ended = None if self.update_id is None else self.receiver.ended(self.update_id)
            self.update_id = None
            if ended is not None:
                raise LifecycleError(f"{what}: the weight update ended without committing ({ended}); none of it "
                                     "serves: start a new one")
            raise LifecycleError(f"{what}: no weight update is in progress: call start_weight_update first")
        return self.update_id


@dataclass(frozen=True)
class _IPCInitInfo:
    """vLLM's IPC init_info: empty (the handles need no rendezvous)."""
